"""Leaving the process on time.

After a preemption the runner exits once its deadline is spent, even if an upload thread is
still blocked on a dead or silent endpoint. A normal `sys.exit` would wait for it: Python joins
every non-daemon thread and every thread-pool worker (the transfer's, daemon or not) before the
process ends, and a read timeout times the retry count can outlast the notice period by minutes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn

from runner.preemption.early import ignore_for_teardown

log = logging.getLogger(__name__)

EXIT_HOOKS_BUDGET_S = 2.0

# Set (never cleared) once work was given up on a deadline; read only by exit_process.
_abandoned = threading.Event()


# set once native threads the interpreter cannot join may still run at exit
_native_threads = threading.Event()


def end_without_teardown() -> None:
    """Have `exit_process` skip the interpreter's final teardown (exit hooks and flushes still
    run): torch.distributed's gloo threads outlive destroy_process_group, and freeing what
    they hold during that teardown can abort the process (SIGABRT, "terminate called without
    an active exception") after its exit code was decided."""
    _native_threads.set()


def note_abandoned_work() -> None:
    """Record that threads may still be blocked on work given up at a deadline (an upload to a
    store that stopped answering), so the exit must not wait for them."""
    _abandoned.set()


def exit_process(code: int) -> NoReturn:
    """Exit with `code`. Normally that is `sys.exit`; after abandoned work, or with non-daemon
    threads still running, the exit hooks run on a clock, streams are flushed and the process
    ends without joining threads. Call it only where the process is yours to end: the CLI's
    entry point, or the end of a training script. From here on SIGTERM/SIGINT/SIGUSR1 are
    ignored: a repeated signal cannot change the exit code."""
    stuck = [
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    ]
    # the code is decided: no late signal may replace it (a no-op outside the main thread)
    ignore_for_teardown()
    if not stuck and not _abandoned.is_set():
        if not _native_threads.is_set():
            sys.exit(code)
    else:
        log.warning(
            "exiting (code %d) without waiting for background threads%s",
            code,
            f" still blocked: {', '.join(stuck[:5])}"
            if stuck
            else " (work given up at a deadline)",
        )
    # What a normal exit runs (user hooks, logging.shutdown) still runs, but on a clock: a
    # hook may itself wait on the stuck threads (finalizers of the transfer's connections).
    hooks = threading.Thread(target=atexit._run_exitfuncs, name="atexit-hooks", daemon=True)
    hooks.start()
    hooks.join(EXIT_HOOKS_BUDGET_S)
    if hooks.is_alive():
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(
                f"runner: exit hooks still running after {EXIT_HOOKS_BUDGET_S:.0f}s; "
                "not waiting for them\n"
            )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
