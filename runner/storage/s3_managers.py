"""The long-lived s3transfer managers of one S3 storage (`Transfers`) and the daemon thread
pool they run their tasks on (`DaemonThreadPool`). s3transfer's model is one manager per
client with each file a future; a manager per call would start and join its thread pools for
every file.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

from s3transfer.manager import TransferConfig, TransferManager

from runner.storage.retry import current_deadline

# how long close() waits for an idle manager's threads to end (they only wake and return)
CLOSE_JOIN_S = 2.0

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class DaemonThreadPool:
    """The executor a long-lived TransferManager runs its tasks on (s3transfer's
    `executor_cls`): up to `max_workers` daemon threads, started as work arrives and kept
    between transfers. Unlike ThreadPoolExecutor's workers, no exit hook joins them: neither
    an idle pool nor a thread blocked on a silent endpoint holds the process's exit, and
    runner.preemption.exiting does not count them as work still running. Like theirs, the
    threads end once the pool is shut down or garbage-collected (a storage never closed)."""

    def __init__(self, max_workers: int, *, name: str) -> None:
        self._max = max_workers
        self._name = name
        self._work: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # released by a worker each time it waits again
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        # the workers hold the queue, never the pool: collecting the pool ends them
        self._finalizer = weakref.finalize(self, _end_workers, self._work, self._threads)

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._work.put((future, fn, args))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(
                    target=_work,
                    args=(self._work, self._idle),
                    name=f"{self._name}_{len(self._threads)}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
        return future

    @property
    def threads(self) -> list[threading.Thread]:
        """Its worker threads still alive."""
        with self._lock:
            return [t for t in self._threads if t.is_alive()]

    def shutdown(self, wait: bool = True, *, timeout: float | None = None) -> None:
        """Take no more work; each thread ends after the work queued before. `wait`: join
        them, for at most `timeout` seconds in all (None: however long they take)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        self._finalizer()
        if wait:
            until = None if timeout is None else time.monotonic() + timeout
            for thread in threads:
                thread.join(None if until is None else max(0.0, until - time.monotonic()))


def _work(work: queue.SimpleQueue[_Task | None], idle: threading.Semaphore) -> None:
    while (item := work.get()) is not None:
        future, fn, args = item
        item = None  # hold nothing of a finished task while idle
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiter, like ThreadPoolExecutor
                future.set_exception(exc)
        del future, fn, args
        idle.release()


def _end_workers(work: queue.SimpleQueue[_Task | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        work.put(None)


@dataclass(eq=False)
class _Lane:
    manager: TransferManager
    pools: list[DaemonThreadPool]
    running: int = 0  # transfers started on it and not yet waited for


@dataclass(eq=False)
class Transfers:
    """The TransferManagers of one S3 storage: built lazily, shared by every transfer, shut
    down by `close` (s3transfer's model: one manager per client, each file a future).

    Two lanes, one manager each: transfers made under a store deadline (the stop's final
    upload) get their own, because a manager serves its transfers' requests first come, first
    served on one pool, and the final upload must never queue behind a periodic upload's parts
    (or wait for one stalled on a dead connection). Everything else shares the other."""

    client: Any
    config: TransferConfig
    started: int = field(default=0, init=False)
    """Managers built so far: one per lane in use, and again for a lane used after `close`."""
    _lanes: dict[bool, _Lane] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def run(self, start: Callable[[TransferManager], Any]) -> None:
        """Start one transfer (`start(manager)` returns its TransferFuture) on this thread's
        lane and wait for it. Its failure is raised once all its requests have ended (as a
        manager of its own would: the multipart abort comes after them); a wait interrupted
        otherwise cancels the transfer, leaving the manager to the others."""
        with self._lane() as manager:
            future = start(manager)
            try:
                future.result()
            except BaseException:
                future.cancel()  # no-op once it failed; its own work only
                raise

    @contextlib.contextmanager
    def _lane(self) -> Iterator[TransferManager]:
        urgent = current_deadline() is not None
        with self._lock:
            lane = self._lanes.get(urgent)
            if lane is None:
                lane = self._lanes[urgent] = self._new_lane(
                    "s3-transfer-deadline" if urgent else "s3-transfer"
                )
            lane.running += 1
        try:
            yield lane.manager
        finally:
            with self._lock:
                lane.running -= 1

    def threads(self) -> list[threading.Thread]:
        """The live worker threads of its managers (none once closed and idle)."""
        with self._lock:
            pools = [pool for lane in self._lanes.values() for pool in lane.pools]
        return [thread for pool in pools for thread in pool.threads]

    def _new_lane(self, name: str) -> _Lane:
        pools: list[DaemonThreadPool] = []

        def pool(max_workers: int) -> DaemonThreadPool:
            made = DaemonThreadPool(max_workers, name=f"{name}-{self.started}.{len(pools)}")
            pools.append(made)
            return made

        # a factory, not a class: s3transfer only calls it with max_workers
        manager = TransferManager(self.client, config=self.config, executor_cls=cast(Any, pool))
        self.started += 1
        return _Lane(manager, pools)

    def close(self) -> None:
        """Shut the managers down. An idle one ends its threads before this returns; one with
        a transfer still running (a thread given up on at a deadline) is not waited for: its
        pools take no more work and their threads end once their requests return. A transfer
        started later builds a new manager."""
        with self._lock:
            lanes = [(lane, lane.running) for lane in self._lanes.values()]
            self._lanes.clear()
        # Not TransferManager.shutdown: it waits, unbounded, for every transfer it ever
        # tracked, and a cancelled one's requests may still be blocked on a silent endpoint.
        # The pools are ended directly; an idle one's threads are joined, on a clock.
        until = time.monotonic() + CLOSE_JOIN_S
        for lane, running in lanes:
            for pool in lane.pools:
                pool.shutdown(wait=not running, timeout=max(0.0, until - time.monotonic()))
