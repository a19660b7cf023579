"""The background saver: the loop hands a snapshot over and goes on training.

`BackgroundSaver` implements the checkpointer's `Saver` with one worker thread: `save` queues
the snapshot's persist (serialise, sha256, fsync, commit, then bookkeeping, retention and the
mirror hand-off) and returns at once. At most one save is in flight: the checkpointer waits
for it before it captures the next one, and the host buffers a snapshot lives in are reused
by the next capture, so the wait is also what keeps them consistent.

Periodic saves persist at a lower scheduling priority (runner.system.priority): where the
loop and the save compete for cores, the loop keeps them and the save takes what is idle. The
final save (`reason` "stop" or "final": the loop waits for it, and a preempted node's grace
period runs) persists at normal priority on a thread of its own.

A save that fails in the background is never raised on the worker or lost: it is kept until
the loop asks (`take_failure`, at its next step boundary) or waits for it (`result()` of its
handle). Either way it is reported once. The previous checkpoint is untouched by a failure:
the writer commits by rename, manifest last.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

from runner.checkpoint.writer import CommittedCheckpoint
from runner.session.checkpointer import Persist, Snapshot
from runner.system.priority import lower_this_thread

log = logging.getLogger(__name__)

URGENT_REASONS = ("stop", "final")
"""Saves the loop waits for: persisted at normal priority."""


class _InFlight:
    """The handle of one background save."""

    def __init__(self, future: Future[CommittedCheckpoint], step: int) -> None:
        self.future = future
        self.step = step
        self.claimed = False  # its outcome was handed to a caller (result() or take_failure)

    def result(self) -> CommittedCheckpoint:
        """Wait for the commit; raises what persisting raised (claiming the failure)."""
        self.claimed = True
        return self.future.result()


class BackgroundSaver:
    """Persists each snapshot on one worker thread; at most one in flight."""

    def __init__(self, persist: Persist, *, low_priority: bool = True) -> None:
        self._persist = persist
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="runner-saver",
            initializer=lower_this_thread if low_priority else None,
        )
        # started on the first final save: a niced thread cannot be made urgent again
        self._urgent: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._current: _InFlight | None = None
        self._last: CommittedCheckpoint | None = None
        # failures of saves that were replaced by a newer one before anyone asked: a save
        # that fails while the next capture waits for it is reported all the same
        self._unreported: list[tuple[int, BaseException]] = []

    def save(self, snapshot: Snapshot) -> _InFlight:
        self.wait_for_saving()  # the checkpointer did already; a direct caller may not have
        future = self._pool_for(snapshot).submit(self._persist, snapshot)
        pending = _InFlight(future, snapshot.step)
        with self._lock:
            replaced = self._unclaimed_failure()
            if replaced is not None:
                self._unreported.append(replaced)
            self._current = pending
        return pending

    def _pool_for(self, snapshot: Snapshot) -> ThreadPoolExecutor:
        if snapshot.reason not in URGENT_REASONS:
            return self._pool
        if self._urgent is None:
            self._urgent = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner-final")
        return self._urgent

    def wait_for_saving(self) -> CommittedCheckpoint | None:
        """Block until the save in flight has ended; returns the newest committed checkpoint.
        A failure is not raised here: it stays for `take_failure` (or `result()`)."""
        with self._lock:
            current = self._current
        if current is not None:
            # wait() raises nothing of the save's; an interrupt during the wait (Ctrl-C, a
            # signal handler's exit) propagates: the save is still in flight, its buffers
            # must not be captured into
            wait([current.future])
            if current.future.exception() is None:
                self._last = current.future.result()
        return self._last

    @property
    def in_flight(self) -> bool:
        with self._lock:
            current = self._current
        return current is not None and not current.future.done()

    def take_failure(self) -> tuple[int, BaseException] | None:
        """The step and error of a save that failed and was not reported yet (non-blocking:
        a save still running has not failed yet)."""
        with self._lock:
            if self._unreported:
                return self._unreported.pop(0)
            return self._unclaimed_failure()

    def _unclaimed_failure(self) -> tuple[int, BaseException] | None:
        """The current save's failure if it has ended with one nobody claimed (claims it);
        the caller holds the lock."""
        current = self._current
        if current is None or current.claimed or not current.future.done():
            return None
        failure = current.future.exception()
        if failure is None:
            return None
        current.claimed = True
        return current.step, failure

    def close(self) -> None:
        """Wait for the save in flight, then stop the worker. A failure nobody claimed is
        logged here, so that no failed save goes unsaid."""
        self.wait_for_saving()
        while (unclaimed := self.take_failure()) is not None:
            step, failure = unclaimed
            log.error("checkpoint step %d was not committed: %s", step, failure)
        self._pool.shutdown(wait=True)
        if self._urgent is not None:
            self._urgent.shutdown(wait=True)
