"""Which checkpoint is newest: one rule for every walk (resume, `ls`, verify, retention).

A run resumed at more ranks re-bases its step down (step x N / M), so a newer state can carry
a lower number than an older one. Newest is therefore by progress: the most samples seen,
then the larger step. Checkpoints without counters (seed files adopted with samples_seen 0)
have no progress to compare, so when any candidate lacks them all are ordered by step. A
checkpoint whose manifest cannot be read takes its place by step number; the walk refuses it
when it gets there.

In one lineage samples grow with the step, so the order is the step order; the two differ
only while a re-based run's older, higher-numbered checkpoints still exist (a crash before
the re-base set them aside), and then the re-based lineage's newer work wins.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.manifest import Manifest
from runner.errors import IntegrityError, RunnerError
from runner.storage.base import Storage


class CommittedCheckpoint(Protocol):
    """What runner.checkpoint.writer.CommittedCheckpoint has that ordering needs (a protocol:
    the writer imports verify, through its existing-step policy, and verify orders by this
    module)."""

    @property
    def step(self) -> int: ...

    @property
    def path(self) -> Path: ...

    @property
    def manifest(self) -> Manifest: ...


@dataclass(frozen=True)
class Progress:
    step: int
    samples: int  # 0: unknown (no counters)

    @classmethod
    def of(cls, ckpt: CommittedCheckpoint) -> Progress:
        return cls.of_manifest(ckpt.manifest)

    @classmethod
    def of_manifest(cls, manifest: Manifest) -> Progress:
        return cls(step=manifest.step, samples=manifest.samples_seen)

    def newer_than(self, other: Progress | None) -> bool:
        """More samples (same samples: a larger step); by step when either has no counters."""
        if other is None:
            return True
        if self.samples == 0 or other.samples == 0:
            return self.step > other.step
        return (self.samples, self.step) > (other.samples, other.step)


def newer(ckpt: CommittedCheckpoint, than: CommittedCheckpoint | None) -> bool:
    """Whether `ckpt` supersedes `than`: newer by progress, or the same state re-based at a
    lower step (the trainer set `than`'s directory aside: its state now lives at `ckpt`)."""
    if than is None:
        return True
    mine, theirs = Progress.of(ckpt), Progress.of(than)
    if mine.newer_than(theirs):
        return True
    rebased = mine.samples == theirs.samples != 0 and ckpt.step < than.step
    return rebased and not than.path.is_dir()


def newest_of(progress: Iterable[Progress]) -> Progress | None:
    best: Progress | None = None
    for p in progress:
        if p.newer_than(best):
            best = p
    return best


def newest_first(manifests: Mapping[int, Manifest | None]) -> list[int]:
    """The steps of `manifests` (None: a manifest that cannot be read), newest first by the
    rule of the module docstring."""
    readable = {step: m for step, m in manifests.items() if m is not None}
    by_step = any(m.samples_seen == 0 for m in readable.values())
    ordered = sorted(
        readable, key=lambda s: s if by_step else (readable[s].samples_seen, s), reverse=True
    )
    unreadable = sorted((s for s, m in manifests.items() if m is None), reverse=True)
    walk: list[int] = []
    for step in ordered:  # each unreadable step before the first readable one numbered below
        while unreadable and unreadable[0] > step:
            walk.append(unreadable.pop(0))
        walk.append(step)
    return walk + unreadable


def read_manifests(
    storage: Storage, steps: Iterable[int], *, unread: dict[int, RunnerError] | None = None
) -> dict[int, Manifest | None]:
    """Each step's manifest at `storage` (bounded, parsed, its named step), None for one that
    is missing or does not parse. A store that fails (after its retries) raises: nothing can
    be ordered without it, and its first error is the one that says how. With `unread`, no
    error is raised: each step's goes there (`runner ls` shows each on its row). One after
    another, newest-numbered first, in this thread: a stop's store deadline (a context
    variable) bounds each read, and a store holds a handful (--keep)."""
    kept: type[RunnerError] = IntegrityError if unread is None else RunnerError

    def read(step: int) -> Manifest | None:
        try:
            return read_manifest(storage, step)
        except kept as exc:
            if unread is not None:
                unread[step] = exc
            return None

    return {step: read(step) for step in sorted(steps, reverse=True)}


def steps_newest_first(storage: Storage) -> list[int]:
    """The committed checkpoints at `storage`, newest first by progress."""
    return newest_first(read_manifests(storage, list_checkpoints(storage)))
