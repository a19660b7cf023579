"""Thread scheduling priority: background work that leaves the cores to the training loop.

Linux keeps a nice value per thread (`setpriority(PRIO_PROCESS, tid)`), and a thread starts
with its creator's, so raising it on a worker thread also covers the helper threads that
worker starts (the save's hashing threads). An unprivileged thread can raise its nice value
but never lower it again: work that must not wait (the final save) runs on another thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10
"""How much lower a background save runs: under contention the loop's threads get ~90% of a
shared core (scheduler weights 1024 against 110), and an idle core is still the save's."""


def lower_this_thread(by: int = BACKGROUND_NICE) -> bool:
    """Raise the calling thread's nice value by `by` (at most to 19). Best effort: False,
    and the thread runs as before, where the platform has no per-thread nice value."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + by))
    except OSError as exc:
        log.debug("could not lower the priority of thread %d: %s", tid, exc)
        return False
    return True
