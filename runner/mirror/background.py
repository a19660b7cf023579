"""`Mirror`: uploads committed checkpoints without blocking training, and the final one
before exit within a deadline.

One background thread uploads periodic checkpoints. The queue holds one slot and the newest
wins: a checkpoint superseded by a newer one before its upload started is skipped (and logged),
since only the newest matters for resume. After each upload the mirror keeps the newest K
checkpoints, never deleting one being uploaded or the newest verified one.

Long (about 370 lines): `Mirror` is one state machine (the queue slot, the uploads in flight,
retention, the final upload under a deadline) guarded by one condition variable; split, that
lock would be shared across modules.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from runner.checkpoint.orphans import ORPHAN_MIN_AGE_S, sweep_orphans
from runner.checkpoint.resume_point import ResumePoint
from runner.checkpoint.retention import prune
from runner.checkpoint.verify import check_remote_sizes
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import (
    ConfigError,
    IntegrityError,
    RunnerError,
    SchemaError,
    StorageConflictError,
)
from runner.mirror.resume import LoadFn, SkipCallback, choose_resume
from runner.mirror.upload import remote_manifest, upload_checkpoint
from runner.preemption.exiting import note_abandoned_work
from runner.storage.base import ProgressCallback, Storage
from runner.storage.retry import store_deadline

log = logging.getLogger(__name__)

ORPHAN_SWEEP_EVERY_S = 3600.0


class MirrorMetrics(Protocol):
    """What the mirror reports (runner.metrics.registry.RunnerMetrics implements it)."""

    def checkpoint_uploaded(self, *, step: int, duration_s: float) -> None: ...

    def checkpoint_failed(self, stage: str) -> None: ...


class Mirror:
    def __init__(
        self,
        storage: Storage,
        *,
        keep: int,
        writer_id: str,
        metrics: MirrorMetrics | None = None,
    ) -> None:
        if keep < 2:
            raise ConfigError(f"mirror keep must be >= 2 (got {keep})")
        self.storage = storage
        self.keep = keep
        self.writer_id = writer_id
        self.metrics = metrics
        self._cond = threading.Condition()
        self._pending: CommittedCheckpoint | None = None
        self._active: set[int] = set()  # steps being uploaded right now (worker or final)
        self._worker_step: int | None = None  # what the background thread is uploading
        self._closing = False
        self._last_sweep: float | None = None  # monotonic; only the uploading threads use it
        self._worker: threading.Thread | None = None
        self.last_uploaded: int | None = None
        # steps this mirror uploaded (each file checked) or found good: retention trusts them
        self._known_good: set[int] = set()
        # steps whose copy in the mirror failed verification at resume: checked on upload
        self._suspect: set[int] = set()
        self.last_error: str | None = None
        # small files copied up after each background upload (the attempt record): key -> path
        self._records: dict[str, Path] = {}
        # one copy at a time, never one shorter than the last (a record only grows)
        self._record_lock = threading.Lock()
        self._record_sizes: dict[str, int] = {}

    # -- background uploads --------------------------------------------------------------

    def submit(self, ckpt: CommittedCheckpoint) -> None:
        """Queue a checkpoint for upload and return at once (newest wins)."""
        with self._cond:
            if self._closing:
                raise RunnerError("the mirror is closed; cannot queue more uploads")
            previous = self._pending
            if previous is not None and previous.step > ckpt.step:
                log.info("mirror: not queueing step %d, step %d is newer", ckpt.step, previous.step)
                return
            if previous is not None and previous.step != ckpt.step:
                log.info(
                    "mirror: skipping upload of step %d: superseded by step %d before it started",
                    previous.step,
                    ckpt.step,
                )
            self._pending = ckpt
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="checkpoint-mirror", daemon=True
                )
                self._worker.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                ckpt, self._pending = self._pending, None
                self._active.add(ckpt.step)
                self._worker_step = ckpt.step
            try:
                self._upload(ckpt)
                self._prune(newest_ok=ckpt.step)
                self._put_records()
            except RunnerError:
                pass  # already logged and counted; the next checkpoint tries again
            except Exception as exc:  # never let the worker die: training must go on
                log.exception("mirror: unexpected failure uploading step %d", ckpt.step)
                self._failed(ckpt.step, f"unexpected failure: {exc}")
            finally:
                with self._cond:
                    self._active.discard(ckpt.step)
                    self._worker_step = None
                    self._cond.notify_all()

    def attach_record(self, path: Path, key: str) -> None:
        """Copy `path` to `key` after each background upload from now on (an attempt
        record: it then reaches the mirror with the checkpoints its events describe)."""
        with self._cond:
            self._records[key] = path

    def _put_records(self) -> None:
        with self._cond:
            records = dict(self._records)
        for key, path in records.items():
            try:
                self.put_record(key, path)
            except Exception as exc:  # counted; the next upload copies it again
                log.warning("mirror: could not copy %s: %s", key, exc)
                if self.metrics is not None:
                    self.metrics.checkpoint_failed("attempts")

    def put_record(self, key: str, path: Path) -> None:
        """Copy the file at `path` to `key` now, unless a longer copy of it is there already
        (the worker and an exit may both copy it: the newest bytes win)."""
        with self._record_lock:
            data = path.read_bytes()
            if len(data) < self._record_sizes.get(key, 0):
                return
            self.storage.put_bytes(key, data)
            self._record_sizes[key] = len(data)

    # -- the final checkpoint ------------------------------------------------------------

    def upload_now(self, ckpt: CommittedCheckpoint, *, deadline: float | None = None) -> bool:
        """Upload in the caller's time, within `deadline` (a time.monotonic() instant).
        Returns whether the checkpoint is durable in the mirror; the log says which."""
        if ckpt.store_uri is not None:
            # the ranks of several nodes committed it there: durable already, whatever the
            # deadline (retention waits for the next run's first upload)
            self._upload(ckpt)  # bookkeeping only: no store call
            log.info("final checkpoint step %d is durable in %s", ckpt.step, self.storage.uri)
            return True
        with self._cond:
            if self._pending is not None and self._pending.step <= ckpt.step:
                log.info(
                    "mirror: skipping upload of step %d: superseded by final step %d",
                    self._pending.step,
                    ckpt.step,
                )
                self._pending = None
            self._active.add(ckpt.step)
        started = time.monotonic()
        outcome: list[bool] = []

        def work() -> None:
            try:
                # in this thread: the deadline is a context variable; no store call of the
                # upload waits past it or starts a retry after it
                with store_deadline(deadline):
                    self._upload(ckpt)
                outcome.append(True)  # durable now: retention below is not part of the deadline
                self._prune(newest_ok=ckpt.step)
            except RunnerError:
                outcome.append(False)  # logged and recorded by _upload
            except Exception as exc:  # a bug or an unforeseen OS error: say which step
                log.exception("mirror: unexpected failure uploading step %d", ckpt.step)
                self._failed(ckpt.step, f"unexpected failure: {exc}")
                outcome.append(False)
            finally:
                with self._cond:
                    self._active.discard(ckpt.step)
                    self._cond.notify_all()

        # a thread, so that a deadline can be honoured even when a request hangs
        thread = threading.Thread(target=work, name=f"final-upload-{ckpt.step}", daemon=True)
        thread.start()
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._report_final(
            ckpt,
            timed_out=thread.is_alive() and not outcome,
            durable=bool(outcome) and outcome[0],
            elapsed=time.monotonic() - started,
            deadline=deadline,
        )

    def _report_final(
        self,
        ckpt: CommittedCheckpoint,
        *,
        timed_out: bool,
        durable: bool,
        elapsed: float,
        deadline: float | None,
    ) -> bool:
        """Log how the final upload ended (`timed_out`: still running at its deadline with
        no outcome) and return `durable`, whether the checkpoint is durable in the mirror."""
        if timed_out:
            log.error(
                "final checkpoint step %d did NOT reach %s before the deadline (%.1fs spent); "
                "the next run resumes from the newest checkpoint already there",
                ckpt.step,
                self.storage.uri,
                elapsed,
            )
            self._failed(ckpt.step, "deadline passed")
            note_abandoned_work()  # its transfer threads must not hold the process's exit
            return False
        if not durable:
            log.error(
                "final checkpoint step %d did NOT reach %s: %s",
                ckpt.step,
                self.storage.uri,
                self.last_error,
            )
            return False
        spare = f", {deadline - time.monotonic():.1f}s before the deadline" if deadline else ""
        log.info(
            "final checkpoint step %d is durable in %s (%.1fs%s)",
            ckpt.step,
            self.storage.uri,
            elapsed,
            spare,
        )
        return True

    # -- shared ----------------------------------------------------------------------------

    def _upload(self, ckpt: CommittedCheckpoint) -> None:
        started = time.monotonic()
        try:
            # a checkpoint the ranks of several nodes committed in the store is there already
            if ckpt.store_uri is None:
                upload_checkpoint(
                    self.storage,
                    ckpt.path,
                    writer_id=self.writer_id,
                    verify_existing=ckpt.step in self._suspect,
                )
        except StorageConflictError as exc:
            log.warning("mirror: %s", exc)
            self._failed(ckpt.step, str(exc))
            raise
        except RunnerError as exc:
            log.error(
                "mirror: upload of step %d to %s failed: %s", ckpt.step, self.storage.uri, exc
            )
            self._failed(ckpt.step, str(exc))
            raise
        duration = time.monotonic() - started
        with self._cond:
            self.last_uploaded = max(self.last_uploaded or -1, ckpt.step)
            self.last_error = None
            self._suspect.discard(ckpt.step)
            self._known_good.add(ckpt.step)
        if self.metrics is not None:
            self.metrics.checkpoint_uploaded(step=ckpt.step, duration_s=duration)

    def _prune(self, *, newest_ok: int) -> None:
        with self._cond:
            protect = set(self._active)
        try:
            prune(
                self.storage,
                keep=self.keep,
                protect=protect | {newest_ok},
                newest_ok=newest_ok,
                known_good=self._known_good,
                remote_sizes_only=True,
            )
            # debris only matters once a day old: one listing and a manifest read per step an
            # hour is enough, not after every upload
            now = time.monotonic()
            if self._last_sweep is None or now - self._last_sweep >= ORPHAN_SWEEP_EVERY_S:
                self._last_sweep = now
                sweep_orphans(self.storage, older_than_s=ORPHAN_MIN_AGE_S, protect=protect)
        except RunnerError as exc:  # retention failing must not fail the upload
            log.warning("mirror: pruning %s failed: %s", self.storage.uri, exc)

    def _failed(self, step: int, why: str) -> None:
        with self._cond:
            self.last_error = f"step {step}: {why}"
        if self.metrics is not None:
            self.metrics.checkpoint_failed("upload")

    def in_flight_steps(self) -> set[int]:
        """Steps queued or being uploaded: local retention must keep their directories."""
        with self._cond:
            pending = {self._pending.step} if self._pending is not None else set()
            return pending | self._active

    def choose_resume(
        self,
        run_dir: Path,
        *,
        load: LoadFn | None = None,
        on_skip: SkipCallback | None = None,
        progress: ProgressCallback | None = None,
        fresh_start: bool = False,
        refusal_log_level: int = logging.WARNING,
    ) -> ResumePoint[Any] | None:
        """`choose_resume` over the run dir and this mirror's storage (callers go through
        runner.runtime.lifecycle.find_resume). A step of the mirror found corrupt on the way
        is remembered: uploading that step again checks the copy already there and replaces
        it when it is bad (a heal), even when its manifest matches the new save."""
        choice = choose_resume(
            run_dir,
            self.storage,
            load=load,
            on_skip=on_skip,
            progress=progress,
            fresh_start=fresh_start,
            refusal_log_level=refusal_log_level,
        )
        if choice is not None:
            with self._cond:
                self._suspect |= {r.step for r in choice.refused if r.remote is not None}
                if choice.from_mirror:  # a local choice says nothing of the mirror's copy
                    self._known_good.add(choice.manifest.step)
        return choice

    def holds(self, step: int) -> bool:
        """Whether the mirror holds checkpoint `step` whole, by the cheap check (manifest and
        every file's size; no download). A copy that fails it is remembered as suspect, so
        the next upload of that step verifies and heals it."""
        try:
            check_remote_sizes(self.storage, step)
        except SchemaError as exc:  # another version's checkpoint: never replaced
            log.warning("mirror: step %d there is one this runner cannot read: %s", step, exc)
            return True
        except IntegrityError as exc:
            if remote_manifest(self.storage, step) is None:
                return False  # not there (or no readable manifest: the upload settles it)
            log.warning("mirror: its copy of step %d is damaged (%s); replacing it", step, exc)
            with self._cond:
                self._suspect.add(step)
            return False
        except RunnerError:
            return False
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the background queue is empty and its thread idle; False on timeout.
        (`upload_now` blocks its caller, so it is never waited for here.)"""
        return self._wait(lambda: self._pending is None and self._worker_step is None, timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """Finish what is queued, then stop the worker. Uploads older than a checkpoint that
        already landed (e.g. a periodic one overtaken by the final upload) are not waited
        for: at shutdown the grace period belongs to the newest checkpoint."""

        def settled() -> bool:
            newest = self.last_uploaded if self.last_uploaded is not None else -1
            if self._pending is not None and self._pending.step <= newest:
                log.info(
                    "mirror: dropping queued step %d, step %d is already uploaded",
                    self._pending.step,
                    newest,
                )
                self._pending = None
            busy = self._worker_step is not None and self._worker_step > newest
            return self._pending is None and not busy

        finished = self._wait(settled, timeout)
        with self._cond:
            self._closing = True
            idle = self._worker_step is None
            if not finished:
                note_abandoned_work()
                left = sorted(self._active | ({self._pending.step} if self._pending else set()))
                log.error(
                    "mirror: abandoning upload of step(s) %s to %s: out of time (%.1fs); what "
                    "is already there stays valid (manifests go last)",
                    ", ".join(map(str, left)),
                    self.storage.uri,
                    timeout or 0.0,
                )
                self._pending = None
            self._cond.notify_all()
        if self._worker is not None and idle:
            self._worker.join(timeout)

    def _wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not done():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True
