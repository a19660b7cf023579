"""Whether a process id names a live process: the owner check of the run-dir lock's holder
record and of a temp name's pid."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host. One that we may not signal
    (another user's) exists too; a zombie still counts, as `kill(pid, 0)` reports it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
