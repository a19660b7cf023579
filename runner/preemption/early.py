"""Signals before a StopController exists, and after the work is done.

`runner` installs `record_early` for SIGTERM/SIGINT/SIGUSR1 as the very first thing its entry
point does, before click, torch or boto3 are imported (seconds on a cold node): a signal then
only lands in `EARLY` and `install_signal_handlers` replays it into the controller later. On
the way out (`ignore_late`), the same signals are recorded and ignored, so a repeated SIGTERM
cannot turn an exit code that was already decided into death by signal.

Only `signal` and `time` are imported here: this module is loaded while the process is still
starting. Handlers only append to a list (atomic under the GIL; no lock, see stop.py).
"""

from __future__ import annotations

import signal
import time
from types import FrameType

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

# (signal number, time.monotonic() of arrival), in arrival order; drained by the replay.
EARLY: list[tuple[int, float]] = []
# Signals recorded and ignored after a stop or after the command returned.
LATE: list[tuple[int, float]] = []


def record_early(signum: int, frame: FrameType | None) -> None:
    EARLY.append((signum, time.monotonic()))


def record_late(signum: int, frame: FrameType | None) -> None:
    LATE.append((signum, time.monotonic()))


def install_early_handlers() -> None:
    """Record SIGTERM/SIGINT/SIGUSR1 from now on (main thread, entry points only)."""
    for sig in HANDLED:
        signal.signal(sig, record_early)


def early_handlers_installed() -> bool:
    return signal.getsignal(signal.SIGTERM) is record_early


def take_early() -> list[tuple[int, float]]:
    """The signals recorded so far, oldest first, removed from the record."""
    taken = EARLY[:]
    del EARLY[: len(taken)]
    return taken


def release_early() -> None:
    """For a command that never installs a StopController (`runner ls`, `verify`, ...): the
    default dispositions back (SIGINT raises KeyboardInterrupt, SIGTERM ends the process),
    and a signal recorded meanwhile is delivered now, as if it had just arrived."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum, _ in take_early():
        signal.raise_signal(signum)


def ignore_late() -> None:
    """From now on SIGTERM/SIGINT/SIGUSR1 are recorded and ignored (main thread only)."""
    for sig in HANDLED:
        signal.signal(sig, record_late)


def ignore_for_teardown() -> None:
    """SIG_IGN for the interpreter's teardown: Python puts SIG_DFL back in place of every
    Python-level handler late in finalization, so only the kernel's ignore holds to the end.
    No-op outside the main thread (signal.signal would raise there)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        signal.signal(sig, signal.SIG_IGN)
