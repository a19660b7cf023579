"""What a session saves and loads: the `TrainState` protocol (and the optional methods that
make saving and loading exact), the `Snapshot` of one save, `capture` on the training loop
between two optimizer steps, and `load_into` the live objects.

A capture holds the payload dict (the live tensors, or for a background saver their copies in
reused host buffers: runner.state.host_copy), the counters and the manifest's fields, and when
the save began; the fingerprint is computed from the snapshot's own tensors (what is saved,
not the live model) by whoever persists it (runner.session.checkpointer).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from runner.checkpoint.writer import CheckpointMeta
from runner.collective.group import SINGLE, Group
from runner.errors import ConfigError
from runner.state.counters import Counters
from runner.state.fingerprint import fingerprint_tensors
from runner.state.host_copy import HostBuffers
from runner.state.ranked import RankedPayload, is_sharded_state


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


def load_into(state: TrainState, read: ReadInto, *, restore_rng: bool = True) -> Counters:
    """Load what `read` gives into the live `state`; returns the counters to continue from.

    A state with `load_into` (LoadsInto) hands `read` its own template; one with only the
    older `restore(dict)` gets the whole payload (read with an empty template)."""
    if isinstance(state, LoadsInto):
        return state.load_into(read, restore_rng=restore_rng)
    return state.restore(read({}), restore_rng=restore_rng)
