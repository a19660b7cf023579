"""How s3:// moves large objects: the transfer settings (part size, concurrency, socket
timeouts sized from the store timeout), the storage's long-lived transfer managers, progress
subscribers, and the checksum an upload's server should report, computed in the one read of
the local file that also checks its sha256.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from s3transfer.manager import TransferConfig, TransferManager
from s3transfer.subscribers import BaseSubscriber
from s3transfer.utils import ChunksizeAdjuster

from runner.atomicity.files import CHUNK
from runner.errors import ConfigError, IntegrityError
from runner.storage.base import ProgressCallback
from runner.storage.retry import current_deadline

MiB = 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferSettings:
    """How large objects are split and how many parts move at once."""

    part_size: int = 16 * MiB
    multipart_threshold: int = 16 * MiB
    concurrency: int = 8
    request_attempts: int = 3
    """Tries of one HTTP request inside botocore (a dropped part is resent alone)."""
    connect_timeout_s: float = 10.0
    """Also bounds each blocked socket send (urllib3 sends the body under it)."""
    read_timeout_s: float = 10.0
    """Per socket read, not per object: a long transfer that keeps moving never hits it. It
    also covers the wait for an answer after a part was handed to the kernel, which on a
    slow link includes draining the socket's send buffer (up to a few MiB)."""
    download_attempts: int = 2
    """Tries of one ranged GET inside s3transfer when its body stream breaks off."""

    def __post_init__(self) -> None:
        if self.part_size < 5 * MiB:
            raise ConfigError("S3 part size must be >= 5 MiB (the S3 minimum)")
        if self.concurrency < 1 or self.request_attempts < 1 or self.download_attempts < 1:
            raise ConfigError("S3 concurrency and request/download attempts must be >= 1")

    @classmethod
    def for_store_timeout(cls, seconds: float) -> TransferSettings:
        """Socket timeouts sized so that one request, botocore's own retries included, takes
        about half the store timeout at most against a store that never answers; never
        above 10 s to connect and 20 s per read, nor below 2 s to connect and 1 s per read
        unless the store timeout itself is shorter. Below 9 s the socket floors leave no
        room for 3 botocore tries: then as many as fit (2, else 1), so that one request
        (`request_worst_s`) still ends within the store timeout."""
        share = seconds / (2 * 3)
        connect = min(10.0, max(min(2.0, seconds), share))
        read = min(20.0, max(min(1.0, seconds), share))
        for attempts in (3, 2, 1):
            settings = cls(
                connect_timeout_s=connect, read_timeout_s=read, request_attempts=attempts
            )
            if settings.request_worst_s() <= seconds:
                break
        return settings

    def request_worst_s(self) -> float:
        """Longest one request can take against a store that accepts and never answers (or
        never accepts): every botocore try times out, plus botocore's backoff between them
        (standard mode: up to 2**(n-1) s before try n+1, at most 20 s)."""
        backoff = sum(min(20.0, 2.0 ** (n - 1)) for n in range(1, self.request_attempts))
        timeout = max(self.connect_timeout_s, self.read_timeout_s)
        return self.request_attempts * timeout + backoff

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.part_size,
            max_request_concurrency=self.concurrency,
            num_download_attempts=self.download_attempts,
        )


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

    def shutdown(self, wait: bool = True) -> None:
        """Take no more work; each thread ends after the work queued before. `wait`: join
        them (only for a pool with nothing in flight: a blocked request would hold it)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        self._finalizer()
        if wait:
            for thread in threads:
                thread.join()


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
        for lane, running in lanes:
            if running:
                for pool in lane.pools:
                    pool.shutdown(wait=False)
            else:
                # never shutdown(cancel=True): s3transfer passes its arguments in the wrong order
                lane.manager.shutdown()


class Moved:
    """When a transfer last moved a byte (time.monotonic()), for the store-timeout budget."""

    def __init__(self) -> None:
        self._at: float | None = None

    def touch(self, _bytes: int) -> None:
        self._at = time.monotonic()

    def at(self) -> float | None:
        return self._at


class Progress(BaseSubscriber):
    def __init__(self, callback: ProgressCallback) -> None:
        self._callback = callback

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._callback(bytes_transferred)


def expected_checksum(src: Path, *, size: int, sha256: str, settings: TransferSettings) -> str:
    """Check the file still has the manifest's sha256 and return the SHA-256 checksum
    the server should report: the full digest for one PUT, the composite of part
    digests ("<b64>-<parts>") for a multipart upload. One read of the file; the part
    digests are computed on a second core (hashlib releases the GIL)."""
    multipart = size >= settings.multipart_threshold
    part_size = ChunksizeAdjuster().adjust_chunksize(settings.part_size, size)
    full = hashlib.sha256()
    parts: list[bytes] = []
    with open(src, "rb") as f, ThreadPoolExecutor(1, "part-digests") as helper:
        while True:
            part = hashlib.sha256()
            remaining = part_size if multipart else size
            while remaining:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    break
                pending = helper.submit(part.update, chunk) if multipart else None
                full.update(chunk)
                if pending is not None:
                    pending.result()
                remaining -= len(chunk)
            if not multipart or remaining == part_size:
                break
            parts.append(part.digest())
    if full.hexdigest() != sha256:
        raise IntegrityError(
            f"{src} no longer matches its manifest (sha256 {full.hexdigest()[:12]}... "
            f"!= {sha256[:12]}...); not uploading a corrupt file"
        )
    if not multipart:
        return base64.b64encode(full.digest()).decode()
    composite = hashlib.sha256(b"".join(parts)).digest()
    return f"{base64.b64encode(composite).decode()}-{len(parts)}"
