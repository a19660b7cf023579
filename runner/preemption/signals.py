"""Signal handlers for entry points (`runner demo`, `runner run`, a user's script).

Only entry points call `install_signal_handlers`; nothing installs handlers at import time.
The handlers only record state in the StopController; the work happens at the next step
boundary (or in the supervisor's loop). Signals are handled from the entry point's first
instant (runner.preemption.early) until the process has exited (`restore` after a stop).
"""

from __future__ import annotations

import atexit
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from runner.errors import ConfigError
from runner.preemption import early
from runner.preemption.stop import StopController

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CHECKPOINT_SIGNALS = (signal.SIGUSR1,)

_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


def install_signal_handlers(
    controller: StopController, *, grace_seconds: float | None = None
) -> Restore:
    """SIGTERM/SIGINT -> stop request (deadline = arrival + grace_seconds when given);
    SIGUSR1 -> checkpoint request. Signals the entry point recorded before this call
    (runner.preemption.early) are replayed into `controller` in arrival order, each stop's
    deadline counted from when it arrived.

    Returns `restore`. Without a stop request it puts the previous handlers back. After a
    stop it does not: the process is on its way out with its exit code decided, so from then
    on SIGTERM/SIGINT/SIGUSR1 are recorded and ignored (and the kernel ignores them for the
    interpreter's teardown), so a repeated signal can never turn exit 75 into death by signal.

    Must be called from the main thread (Python only delivers signals there).
    """
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError("install_signal_handlers must be called from the main thread")

    def stop(signum: int, at: float) -> None:
        deadline = None if grace_seconds is None else at + grace_seconds
        controller.request_stop(signal.Signals(signum).name, deadline=deadline, at=at)

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stop(signum, time.monotonic())

    def on_checkpoint(signum: int, frame: FrameType | None) -> None:
        controller.request_checkpoint(signal.Signals(signum).name)

    previous: dict[int, _Handler] = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, on_stop)
    for sig in CHECKPOINT_SIGNALS:
        previous[sig] = signal.signal(sig, on_checkpoint)
    # Taken only now that our handlers are in place: nothing can land in the early record
    # any more, so none is lost. A signal that arrived meanwhile went straight to the
    # controller, which orders stop reasons by arrival time, not by recording order.
    for signum, at in early.take_early():
        if signum in STOP_SIGNALS:
            stop(signum, at)
        elif signum in CHECKPOINT_SIGNALS:
            controller.request_checkpoint(signal.Signals(signum).name)

    return Restore(controller, previous)


class Restore:
    """What `install_signal_handlers` returns: call it when the entry point is done."""

    def __init__(self, controller: StopController, previous: dict[int, _Handler]) -> None:
        self._controller = controller
        self._previous = previous

    def __call__(self, *, force: bool = False) -> None:
        """The previous handlers back, unless a stop was requested (then: recorded and
        ignored until exit). `force` restores them anyway, for code that goes on after a
        stop on purpose (a test suite, a script running several sessions)."""
        if self._controller.stop_requested and not force:
            early.ignore_late()
            _ignore_during_teardown()
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


_teardown_hooked = False


def _ignore_during_teardown() -> None:
    """A script that ends with sys.exit after a stop: its last moments, after atexit, belong
    to the kernel's SIG_IGN (Python resets Python-level handlers to SIG_DFL while tearing
    down). Registered once, when the first stop is restored, never at import."""
    global _teardown_hooked
    if not _teardown_hooked:
        _teardown_hooked = True
        atexit.register(early.ignore_for_teardown)
