"""Saving and loading a session's checkpoints: capture, persist, load into.

A save has two halves, so that a background saver can take the second one off the loop:

- capture, on the training loop between two optimizer steps: a `Snapshot` holds the payload
  dict (the live tensors, or for a background saver their copies in reused host buffers:
  runner.state.host_copy), the counters and the manifest's fields, and when the save began;
  the fingerprint is computed from the snapshot's own tensors (what is saved, not the live
  model) by whoever persists it;
- persist, by a `Saver`: serialise, hash, fsync and commit (CheckpointWriter), then the
  session's bookkeeping, local retention and the mirror hand-off, in that order.

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
live objects (it may run in a worker that a stop gives up on), and `load_into` puts it into
the live model, optimizer, scheduler, sampler, counters and RNG, the way DCP loads into
existing state dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, runtime_checkable

from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import FORMAT_DCP, Manifest
from runner.checkpoint.room import Room, out_of_space
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.collective.group import SINGLE, Group
from runner.errors import ConfigError, RunnerError
from runner.state.counters import Counters
from runner.state.fingerprint import fingerprint_tensors
from runner.state.host_copy import HostBuffers
from runner.state.ranked import RankedPayload, is_sharded_state

if TYPE_CHECKING:
    from runner.mirror.nodes import NodeBucket

log = logging.getLogger(__name__)

# what a resume from the mirror alone reads for `load_point`: the mirror's manifest, whose
# files each rank fetches itself (runner.mirror.nodes)
IN_BUCKET = "bucket_manifest"


class TrainState(Protocol):
    """What a session needs from the training loop's state (the demo's components and
    `runner.state.train_state.ModuleTrainState` both provide it). The loop advances `counters` and
    `loss_history`. Two optional methods make saving and loading exact (see `LoadsInto` and
    `FingerprintsCaptured`); a state without them is saved and restored through these three."""

    counters: Counters
    loss_history: list[float]

    def capture(
        self, *, copy: bool = False, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any], *, restore_rng: bool = True) -> Counters: ...

    def fingerprint(self) -> str: ...


# Fills a template (the live state in the payload layout, tensors included) from the
# checkpoint and returns the state to load. A whole-file format ignores the template and
# returns what it deserialised; a per-rank DCP reader would load into the template's tensors.
ReadInto = Callable[[dict[str, Any]], dict[str, Any]]


@runtime_checkable
class LoadsInto(Protocol):
    """A TrainState that loads a checkpoint into its live objects (ModuleTrainState does)."""

    def load_into(self, read: ReadInto, *, restore_rng: bool = True) -> Counters: ...


@runtime_checkable
class FingerprintsCaptured(Protocol):
    """A TrainState that can fingerprint one of its own `capture()` results."""

    def fingerprint_captured(self, captured: dict[str, Any]) -> str: ...


@runtime_checkable
class FingerprintsFull(Protocol):
    """A TrainState whose state may be sharded across ranks (the demo under FSDP2): every
    rank calls `full_fingerprint` at once (gathering the full state is collective); the
    primary gets the digest of the full state, the others ""."""

    def full_fingerprint(self, *, primary: bool = True) -> str: ...


@runtime_checkable
class GathersFull(Protocol):
    """A sharded TrainState that gathers its full state for the fingerprint (collective,
    like `full_fingerprint`) and leaves the hashing to whoever persists the snapshot."""

    def gather_full(self, *, primary: bool = True) -> dict[str, Any] | None: ...


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """One captured state on its way to disk: the payload, the manifest's fields and when its
    save began (monotonic; the duration a commit reports is counted from there)."""

    payload: dict[str, Any] | RankedPayload
    """A whole-state payload, or this rank's part of a multi-rank checkpoint."""
    meta: CheckpointMeta
    captured_at: float
    digest: Callable[[], str] | None = None
    """Computes the fingerprint from the payload's own tensors, by whoever persists it (a
    background saver: off the loop); None when `meta.fingerprint` is final already."""
    copy_seconds: float = 0.0
    """The capture alone: the copy into host memory for a background saver."""

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def reason(self) -> str:
        return str(self.meta.extra.get("reason", ""))

    def final_meta(self) -> CheckpointMeta:
        """The manifest's fields with the fingerprint computed (when it was deferred)."""
        if self.digest is None:
            return self.meta
        return dataclasses.replace(self.meta, fingerprint=self.digest())


def capture(
    state: TrainState,
    *,
    reason: str,
    copy_into: HostBuffers | None = None,
    captured_at: float | None = None,
    group: Group = SINGLE,
    extra: dict[str, Any] | None = None,
) -> Snapshot:
    """Snapshot `state` at this step boundary; `captured_at` (monotonic) defaults to now.

    Without `copy_into` (the sync saver) the payload references the live tensors: the persist
    that reads them finishes before the loop's next optimizer step changes them. With it (a
    background saver) every tensor is copied into those reused host buffers before this
    returns, and the rest of the payload is rebuilt, so the loop may go on at once.

    The fingerprint is always that of the payload's own tensors, computed when the snapshot is
    persisted (`Snapshot.digest`), except for a model sharded across ranks: gathering it is a
    collective on the live model, done here by every rank."""
    began = time.monotonic()
    if captured_at is None:
        captured_at = began
    counters = state.counters
    payload: dict[str, Any] | RankedPayload
    digest: Callable[[], str] | None = None
    fingerprint = ""
    if not group.single:
        # each rank its part; the fingerprint of the full state is rank 0's to write
        payload = _capture_ranked(state, group, copy_into)
        if is_sharded_state(payload.tensors) and isinstance(state, GathersFull):
            # every rank gathers (a collective on the live model); rank 0 hashes it later
            gathered = state.gather_full(primary=group.rank == 0)
            if gathered is not None:
                digest = functools.partial(fingerprint_tensors, gathered)
        elif is_sharded_state(payload.tensors) and isinstance(state, FingerprintsFull):
            fingerprint = state.full_fingerprint(primary=group.rank == 0)  # every rank
        elif group.rank == 0 and isinstance(state, FingerprintsFull):
            # a whole model on every rank: rank 0 hashes its (copied) tensors alone
            digest = functools.partial(fingerprint_tensors, payload.tensors)
        elif group.rank == 0:
            fingerprint = state.fingerprint()  # a state of its own layout: its own digest
    else:
        whole = state.capture()
        if copy_into is not None:
            whole = copy_into.snapshot(whole)
        payload = whole
        if isinstance(state, FingerprintsCaptured):
            digest = functools.partial(state.fingerprint_captured, whole)
        else:
            fingerprint = state.fingerprint()  # a state of its own layout: its own digest
    meta = CheckpointMeta(
        step=counters.step,
        samples_seen=counters.samples_seen,
        world_size=counters.world_size,
        epoch=counters.epoch,
        batch_in_epoch=counters.batch_in_epoch,
        fingerprint=fingerprint,
        extra={"reason": reason, **(extra or {})},
    )
    return Snapshot(
        payload=payload,
        meta=meta,
        captured_at=captured_at,
        digest=digest,
        copy_seconds=time.monotonic() - began,
    )


def _capture_ranked(
    state: TrainState, group: Group, copy_into: HostBuffers | None
) -> RankedPayload:
    capture_ranked = getattr(state, "capture_ranked", None)
    if capture_ranked is None:
        raise ConfigError(
            f"{type(state).__name__} cannot be saved by several ranks: a multi-rank run "
            "needs a TrainState with capture_ranked/load_ranked (ModuleTrainState has them)"
        )
    part = capture_ranked(rank=group.rank, world_size=group.world_size)
    assert isinstance(part, RankedPayload)
    if copy_into is None:
        return part
    copied = copy_into.snapshot({"tensors": part.tensors, "shared": part.shared, "own": part.own})
    return dataclasses.replace(part, **copied)


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
    the snapshot to the saver. Persisting it runs, in order: `writer.write_state` (the
    commit), `on_commit` (the caller's bookkeeping: metrics, the log line), `retention`
    (never fails a save) and `hand_off` (the mirror; the callback decides what it takes).

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
        group: Group = SINGLE,
        snapshot_to: HostBuffers | None = None,
        save_group: Group | None = None,
        bucket: NodeBucket | None = None,
        make_room: Callable[[], Room | None] | None = None,
    ) -> None:
        self.writer = writer
        self.group = group  # several ranks: every load (and sync save) is collective over it
        # a background saver's commits run beside the loop's own collectives (the per-step
        # agreement): they need a channel of their own, or the two would interleave
        self.save_group = save_group if save_group is not None else group
        # a background saver: the loop copies the state into these buffers and goes on
        self.snapshot_to = snapshot_to
        # ranks on several nodes: every multi-rank save is committed in the mirror
        self.bucket = bucket
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
                    group=self.group,
                    extra=extra,
                    copy_into=self.snapshot_to,
                )
            except (OSError, RunnerError) as exc:
                self._failed_before_commit(exc, step=state.counters.step)
            return self.saver.save(snapshot)
        finally:
            self.last_stall_seconds = time.monotonic() - started

    def wait_for_saving(self) -> CommittedCheckpoint | None:
        return self.saver.wait_for_saving()

    def take_failure(self) -> tuple[int, BaseException] | None:
        """A background save's failure, once (see `Saver.take_failure`)."""
        return self.saver.take_failure()

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
        if isinstance(snapshot.payload, RankedPayload) and self.bucket is not None:
            from runner.mirror.nodes import commit_to_bucket

            return commit_to_bucket(
                self.writer,
                snapshot.payload,
                meta=meta,
                group=self.save_group,
                bucket=self.bucket,
            )
        if isinstance(snapshot.payload, RankedPayload):
            from runner.checkpoint.ranked import write_ranked

            return write_ranked(self.writer, snapshot.payload, meta=meta, group=self.save_group)
        return self.writer.write_state(snapshot.payload, meta=meta)

    def _retry_with_room(
        self, exc: Exception, snapshot: Snapshot, meta: CheckpointMeta
    ) -> CommittedCheckpoint:
        """A failed commit: when it ran out of space and `make_room` deleted a checkpoint,
        commit again, once, and say so in one line; otherwise (or when the retry fails too)
        the save's failure is raised. The first attempt goes through `on_failure` either way
        (counted once). One process's save only: the ranks of a multi-rank commit would all
        have to agree to retry."""
        no_space = out_of_space(exc)
        if (
            no_space is None
            or self._make_room is None
            or isinstance(snapshot.payload, RankedPayload)
        ):
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
        tensors (`load_point`); an empty dict stands for it."""
        if manifest.format == FORMAT_DCP:
            return {}
        return load_state(step_dir, manifest=manifest, verified=True)

    def load_point(
        self,
        state: TrainState,
        step_dir: Path,
        manifest: Manifest,
        loaded: dict[str, Any],
        *,
        restore_rng: bool = True,
    ) -> Counters:
        """Load a checkpoint `read` gave `loaded` for into the live `state` (every rank of a
        multi-rank run calls it at once)."""
        if manifest.format == FORMAT_DCP:
            from runner.checkpoint.ranked import LoadsRanked, load_ranked

            if not isinstance(state, LoadsRanked):
                raise ConfigError(
                    f"{step_dir} was written by several ranks (torch-dcp) and "
                    f"{type(state).__name__} has no load_ranked: resume it with a "
                    "ModuleTrainState"
                )
            remote = loaded.get(IN_BUCKET)
            if isinstance(remote, Manifest) and self.bucket is not None:
                from runner.mirror.nodes import load_from_bucket

                return load_from_bucket(
                    state,
                    remote,
                    writer=self.writer,
                    group=self.group,
                    bucket=self.bucket,
                    restore_rng=restore_rng,
                )
            return load_ranked(state, step_dir, manifest, group=self.group, restore_rng=restore_rng)
        return self.load_into(state, lambda _template: loaded, restore_rng=restore_rng)

    @staticmethod
    def load_into(
        state: TrainState,
        read: ReadInto,
        *,
        restore_rng: bool = True,
    ) -> Counters:
        """Load what `read` gives into the live `state`; returns the counters to continue from.

        A state with `load_into` (LoadsInto) hands `read` its own template; one with only the
        older `restore(dict)` gets the whole payload (read with an empty template)."""
        if isinstance(state, LoadsInto):
            return state.load_into(read, restore_rng=restore_rng)
        return state.restore(read({}), restore_rng=restore_rng)

    def load_checkpoint_into(
        self, step_dir: Path, manifest: Manifest, state: TrainState
    ) -> Counters:
        """`read` then `load_into`, for a checkpoint verified moments ago."""
        payload = self.read(step_dir, manifest)
        return self.load_into(state, lambda _template: payload)
