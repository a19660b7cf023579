"""Signal handlers for entry points (`runner demo`, `runner run`, a user's script).

Only entry points call `install_signal_handlers`; nothing installs handlers at import time.
The handlers only record state in the StopController; the work happens at the next step
boundary (or in the supervisor's loop).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

from runner.errors import ConfigError
from runner.preemption.stop import StopController

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
CHECKPOINT_SIGNALS = (signal.SIGUSR1,)

_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


def install_signal_handlers(
    controller: StopController, *, grace_seconds: float | None = None
) -> Callable[[], None]:
    """SIGTERM/SIGINT -> stop request (deadline = now + grace_seconds when given);
    SIGUSR1 -> checkpoint request. Returns a function that restores the previous handlers.

    Must be called from the main thread (Python only delivers signals there).
    """
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError("install_signal_handlers must be called from the main thread")

    def on_stop(signum: int, frame: FrameType | None) -> None:
        deadline = None if grace_seconds is None else time.monotonic() + grace_seconds
        controller.request_stop(signal.Signals(signum).name, deadline=deadline)

    def on_checkpoint(signum: int, frame: FrameType | None) -> None:
        controller.request_checkpoint(signal.Signals(signum).name)

    previous: dict[int, _Handler] = {}
    for sig in STOP_SIGNALS:
        previous[sig] = signal.signal(sig, on_stop)
    for sig in CHECKPOINT_SIGNALS:
        previous[sig] = signal.signal(sig, on_checkpoint)

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    return restore
