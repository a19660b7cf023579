"""Start-up work against the store that gives way to a stop request.

Resume resolution lists the mirror and may download a checkpoint; against a store that
accepts connections and never answers, that can take minutes of read timeouts and retries,
far past a preemption's grace period. So it runs in a worker thread while the main thread
waits on the StopController: on a stop the work is given up (runner.preemption.exiting then exits
without joining the thread) and the session exits 75 with nothing trained.

Giving up must not leave the worker free to change the run dir afterwards: whatever it makes
visible (a downloaded checkpoint renamed into `checkpoints/`, a copy set aside) happens inside
`publishing()`, which refuses once the main thread gave up and which the main thread waits
out before it reports giving up. So a publish happened before the stop was honoured, or never.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from runner.errors import StartupInterrupted
from runner.preemption.exiting import note_abandoned_work
from runner.preemption.stop import StopController

__all__ = ["StartupInterrupted", "check_not_abandoned", "publishing", "run_interruptible"]

T = TypeVar("T")

POLL_S = 0.05
# How long giving up waits for a publish already under way (a local rename: milliseconds).
PUBLISH_WAIT_S = 5.0

_worker = threading.local()


class AbandonGate:
    """Shared by one start-up worker and the main thread that may give up on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned = False

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def abandon(self) -> bool:
        """Give up; True when no publish is still under way (waits for one briefly)."""
        self._abandoned = True  # a worker that checks from now on refuses
        if self._lock.acquire(timeout=PUBLISH_WAIT_S):
            self._lock.release()
            return True
        return False

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        with self._lock:
            if self._abandoned:
                raise StartupInterrupted("start-up was given up on: not publishing")
            yield


@contextlib.contextmanager
def publishing() -> Iterator[None]:
    """Wrap anything that makes start-up's work visible in the run dir or the mirror. In a
    start-up worker that was given up on it raises StartupInterrupted; elsewhere (runner
    pull, the supervisor) it does nothing."""
    gate: AbandonGate | None = getattr(_worker, "gate", None)
    if gate is None:
        yield
        return
    with gate.publishing():
        yield


def check_not_abandoned() -> None:
    """Before a store call that changes the mirror (not held under the gate's lock: it may
    hang): raise StartupInterrupted if this start-up worker was given up on."""
    gate: AbandonGate | None = getattr(_worker, "gate", None)
    if gate is not None and gate.abandoned:
        raise StartupInterrupted("start-up was given up on")


def run_interruptible(fn: Callable[[], T], *, stop: StopController, what: str) -> T:
    """`fn()` in a worker thread; its result or its exception. StartupInterrupted (the
    worker left running, abandoned) as soon as `stop` has a stop request, also one that was
    there before the call."""
    gate = AbandonGate()
    done = threading.Event()
    box: dict[str, object] = {}

    def work() -> None:
        _worker.gate = gate
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            box["error"] = exc
        finally:
            done.set()

    if stop.stop_requested:
        raise StartupInterrupted(f"stop requested ({stop.reason}) before {what}")
    worker = threading.Thread(target=work, name=f"startup: {what}", daemon=True)
    worker.start()
    while not done.wait(POLL_S):
        if stop.stop_requested:
            settled = gate.abandon()
            if done.is_set() and "error" not in box:
                break  # it finished meanwhile; its result stands (published or not)
            note_abandoned_work()
            raise StartupInterrupted(
                f"stop requested ({stop.reason}) during {what}: given up"
                + ("" if settled else "; a publish was still under way")
            )
    error = box.get("error")
    if error is not None:
        assert isinstance(error, BaseException)
        raise error
    return box["value"]  # type: ignore[return-value]
