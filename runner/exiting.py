"""Leaving the process on time.

After a preemption the runner exits once its deadline is spent, even if an upload thread is
still blocked on a dead or silent endpoint. A normal `sys.exit` would wait for it: Python joins
every non-daemon thread (the transfer pools' workers among them) before the process ends, and
a read timeout times the retry count can outlast the notice period by minutes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

log = logging.getLogger(__name__)


def exit_process(code: int) -> NoReturn:
    """Exit with `code`; if non-daemon threads are still running, do not wait for them.
    Logs and standard streams are flushed first. Call it only where the process is yours to
    end: the CLI's entry point, or the end of a training script."""
    stuck = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    if not stuck:
        sys.exit(code)
    log.warning(
        "exiting (code %d) without waiting for %d background thread(s) still blocked: %s",
        code,
        len(stuck),
        ", ".join(stuck[:5]),
    )
    # What a normal exit runs (user hooks, logging.shutdown) still runs; only the join of the
    # stuck threads (threading's own shutdown step, not an atexit hook) is skipped.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
