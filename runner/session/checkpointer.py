"""Saving and loading a session's checkpoints: capture, persist, read.

A save has two halves, so that a background saver can take the second one off the loop:

- capture (runner.session.capture), on the training loop between two optimizer steps: a
  `Snapshot` of the payload, the counters and the manifest's fields;
- persist, by a `Saver`: serialise, hash, fsync and commit (the placement's commit:
  runner.session.placement), then the session's bookkeeping, local retention and the mirror
  hand-off, in that order.

Everything one save needs travels in its Snapshot, nothing on the caller: with a background
saver the loop has moved on (and may have begun the next save) when the callbacks run. A
failure before the commit is the save's (`on_failure` classifies it); one after it (the
callbacks) propagates as it is: the checkpoint stands.

`SyncSaver` persists inside `save`, so the loop waits for the commit; `BackgroundSaver`
(runner.session.background) on a worker thread, so the loop waits only for the copy. At most
one save is in flight: `Checkpointer.save` waits for the previous one before it captures
(the host buffers are reused, so this also keeps the snapshot in them whole). A background
save's failure is kept for the loop's next step boundary (`take_failure`).

Loading goes the other way: `read` deserialises a verified checkpoint without touching the
live objects (it may run in a worker that a stop gives up on), and the placement's `load`
puts it into the live model, optimizer, scheduler, sampler, counters and RNG, the way DCP
loads into existing state dicts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import FORMAT_DCP, Manifest
from runner.checkpoint.room import Room, out_of_space
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.errors import CheckpointWriteError, RunnerError
from runner.session.capture import (
    LoadsInto,
    ReadInto,
    Snapshot,
    TrainState,
    capture,
    load_into,
)
from runner.session.placement import OneProcess, Placement
from runner.state.counters import Counters
from runner.state.host_copy import HostBuffers

log = logging.getLogger(__name__)

# importers of the save and load API find it here too (runner.session.capture defines it)
__all__ = [
    "Checkpointer",
    "LoadsInto",
    "PendingSave",
    "Persist",
    "ReadInto",
    "Saver",
    "Snapshot",
    "SyncSaver",
    "TrainState",
    "capture",
]


class PendingSave(Protocol):
    """A save handed to a saver: `result()` blocks until it is committed and returns the
    checkpoint, or raises what persisting it raised."""

    def result(self) -> CommittedCheckpoint: ...


class Saver(Protocol):
    """Persists snapshots; at most one in flight."""

    def save(self, snapshot: Snapshot) -> PendingSave: ...

    def wait_for_saving(self) -> CommittedCheckpoint | None:
        """Block until the save in flight (if any) has ended; returns the newest committed
        checkpoint. A failure is not raised here (see `take_failure`)."""
        ...

    def take_failure(self) -> tuple[int, BaseException] | None:
        """The step and error of a save that failed in the background and was not reported
        yet; None when there is none (never blocks)."""
        ...

    def close(self) -> None: ...


Persist = Callable[[Snapshot], CommittedCheckpoint]


@dataclass(frozen=True)
class CompletedSave:
    """The handle of a save that was committed before `save` returned."""

    committed: CommittedCheckpoint

    def result(self) -> CommittedCheckpoint:
        return self.committed


class SyncSaver:
    """Persists each snapshot inside `save`: nothing is ever in flight after it returns."""

    def __init__(self, persist: Persist) -> None:
        self._persist = persist
        self._last: CommittedCheckpoint | None = None

    def save(self, snapshot: Snapshot) -> PendingSave:
        self._last = self._persist(snapshot)
        return CompletedSave(self._last)

    def wait_for_saving(self) -> CommittedCheckpoint | None:
        return self._last

    def take_failure(self) -> tuple[int, BaseException] | None:
        return None  # a sync save's failure is raised by `save` itself

    def close(self) -> None:
        return None


class Checkpointer:
    """Capture, persist (through a Saver) and load a session's checkpoints.

    A save runs `before_capture` (the session fsyncs its loss log: the loss history is at
    least as durable as the checkpoint) and the capture on the caller's thread, then hands
    the snapshot to the saver. Persisting it runs, in order: the placement's `commit` (one
    process's write_state, or every rank's part), `on_commit` (the caller's bookkeeping:
    metrics, the log line), `retention` (never fails a save) and `hand_off` (the mirror; the
    callback decides what it takes).

    `on_failure(exc, step)` sees an OSError or RunnerError raised before the commit (before
    capture, capture, write) and returns what to raise instead (itself to re-raise it).
    `make_room()` is asked when a commit ran out of space: it deletes an older checkpoint and
    returns what it freed (None when it deleted nothing); the commit is then retried once."""

    def __init__(
        self,
        writer: CheckpointWriter,
        *,
        on_commit: Callable[[CommittedCheckpoint, Snapshot], None] | None = None,
        retention: Callable[[], None] | None = None,
        hand_off: Callable[[CommittedCheckpoint, Snapshot], None] | None = None,
        before_capture: Callable[[], None] | None = None,
        on_failure: Callable[[Exception, int], Exception] | None = None,
        saver: Callable[[Persist], Saver] = SyncSaver,
        snapshot_to: HostBuffers | None = None,
        placement: Placement | None = None,
        make_room: Callable[[], Room | None] | None = None,
    ) -> None:
        self.writer = writer
        # how this way of running captures (its group) and commits (runner.session.placement)
        self.placement = placement if placement is not None else OneProcess()
        # a background saver: the loop copies the state into these buffers and goes on
        self.snapshot_to = snapshot_to
        self.last_stall_seconds: float | None = None  # how long the last save blocked the loop
        self._on_commit = on_commit
        self._retention = retention
        self._hand_off = hand_off
        self._before_capture = before_capture
        self._on_failure = on_failure
        self._make_room = make_room
        self.saver = saver(self.persist)

    # -- saving -------------------------------------------------------------------------------

    def save(
        self, state: TrainState, *, reason: str, extra: dict[str, Any] | None = None
    ) -> PendingSave:
        """Wait for the save in flight, capture `state` and hand the snapshot to the saver.
        The loop is blocked from here until this returns (`last_stall_seconds`): with the
        sync saver that is the whole save, with a background one the wait for the previous
        save (if still running) and the copy into host memory."""
        started = time.monotonic()
        try:
            self.saver.wait_for_saving()
            try:
                if self._before_capture is not None:
                    self._before_capture()
                snapshot = capture(
                    state,
                    reason=reason,
                    captured_at=started,
                    group=self.placement.group,
                    extra=extra,
                    copy_into=self.snapshot_to,
                )
            except (OSError, RunnerError) as exc:
                self._failed_before_commit(exc, step=state.counters.step)
            return self.saver.save(snapshot)
        finally:
            self.last_stall_seconds = time.monotonic() - started

    @property
    def saving(self) -> bool:
        """A background save is persisting (the loop trains beside it)."""
        return bool(getattr(self.saver, "in_flight", False))

    def wait_for_saving(self) -> CommittedCheckpoint | None:
        return self.saver.wait_for_saving()

    def take_failure(self) -> tuple[int, BaseException] | None:
        """A background save's failure, once (see `Saver.take_failure`)."""
        return self.saver.take_failure()

    def raise_failures(self) -> None:
        """Say once that a background save could not be written (its failure metric is
        counted already): the previous checkpoint stands and training goes on, as after a
        failed sync save. Any other failure is raised, as a sync save would have."""
        while (failure := self.take_failure()) is not None:
            _step, exc = failure
            if not isinstance(exc, CheckpointWriteError):
                # anything else (a lost peer, a bug, an object that cannot be saved) ends the
                # run here as it would have inside a sync save
                raise exc
            log.error("%s; training continues", exc)

    def persist(self, snapshot: Snapshot) -> CommittedCheckpoint:
        """The saver's half: commit the snapshot, then bookkeeping, retention, mirror. Only
        the commit's failure is the save's; the callbacks' errors propagate unclassified.
        A commit that found the disk full is retried once if `make_room` freed a checkpoint
        (`_retry_with_room`)."""
        meta: CheckpointMeta | None = None
        try:
            meta = snapshot.final_meta()
            committed = self._commit(snapshot, meta)
        except (OSError, RunnerError) as exc:
            if meta is None:
                self._failed_before_commit(exc, step=snapshot.step)
            committed = self._retry_with_room(exc, snapshot, meta)
        if self._on_commit is not None:
            self._on_commit(committed, snapshot)
        if self._retention is not None:
            self._retention()
        if self._hand_off is not None:
            self._hand_off(committed, snapshot)
        return committed

    def _commit(self, snapshot: Snapshot, meta: CheckpointMeta) -> CommittedCheckpoint:
        return self.placement.commit(self.writer, snapshot.payload, meta)

    def _retry_with_room(
        self, exc: Exception, snapshot: Snapshot, meta: CheckpointMeta
    ) -> CommittedCheckpoint:
        """A failed commit: when it ran out of space and `make_room` deleted a checkpoint,
        commit again, once, and say so in one line; otherwise (or when the retry fails too)
        the save's failure is raised. The first attempt goes through `on_failure` either way
        (counted once). One process's save only: the ranks of a multi-rank commit would all
        have to agree to retry."""
        no_space = out_of_space(exc)
        if no_space is None or self._make_room is None or not self.placement.makes_room:
            self._failed_before_commit(exc, step=snapshot.step)
        try:
            self.writer.cleanup_partial()  # the failed attempt's staging dir, if it outlived it
            room = self._make_room()
        except (OSError, RunnerError) as err:
            log.warning("could not make room for checkpoint step %d: %s", snapshot.step, err)
            room = None
        if room is None:
            self._failed_before_commit(exc, step=snapshot.step)
        if self._on_failure is not None:
            self._on_failure(exc, snapshot.step)  # the first attempt, counted; not raised
        said = (
            f"no room for checkpoint step {snapshot.step} in {self.writer.ckpt_dir} "
            f"({no_space.strerror or no_space}): deleted step {room.deleted} "
            f"({room.freed_bytes / 1e6:.1f} MB freed), the oldest checkpoint older than step "
            f"{room.newest_verified}, the newest verified; the retry"
        )
        try:
            committed = self._commit(snapshot, meta)
        except (OSError, RunnerError) as again:
            log.warning("%s failed too: %s", said, getattr(again, "strerror", None) or again)
            self._failed_before_commit(again, step=snapshot.step)
        log.warning("%s committed it", said)
        return committed

    def _failed_before_commit(self, exc: Exception, *, step: int) -> NoReturn:
        """Raise what `on_failure` makes of a failure before the commit of step `step`."""
        replacement = self._on_failure(exc, step) if self._on_failure is not None else exc
        if replacement is exc:
            raise exc
        raise replacement from exc

    def close(self) -> None:
        """Wait for the save in flight, then release the saver and the host buffers."""
        try:
            self.saver.wait_for_saving()
        finally:
            try:
                self.saver.close()
            finally:
                if self.snapshot_to is not None:
                    self.snapshot_to.release()

    # -- loading ------------------------------------------------------------------------------

    @staticmethod
    def read(step_dir: Path, manifest: Manifest) -> dict[str, Any]:
        """Deserialise a checkpoint that was verified against `manifest` in this process
        moments ago (the resume resolver did); touches no live object. A multi-rank
        (torch-dcp) checkpoint is not read here: its ranks load it together, into the live
        tensors (the placement's `load`); an empty dict stands for it."""
        if manifest.format == FORMAT_DCP:
            return {}
        return load_state(step_dir, manifest=manifest, verified=True)

    def load_checkpoint_into(
        self, step_dir: Path, manifest: Manifest, state: TrainState
    ) -> Counters:
        """`read` then `load_into`, for a checkpoint verified moments ago."""
        payload = self.read(step_dir, manifest)
        return load_into(state, lambda _template: payload)
