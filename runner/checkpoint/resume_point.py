"""The one result of every resume walk: the checkpoint a run continues from, what loading it
made, and the newer checkpoints refused on the way (runner.mirror.resume picks it; the
session, the supervisor and the ranks of several nodes carry it unchanged)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from runner.checkpoint.manifest import Manifest
from runner.checkpoint.writer import CommittedCheckpoint
from runner.storage.base import Storage

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """One checkpoint that cannot be resumed from, and why."""

    step: int
    why: str
    """What was refused and why, naming the local path or the mirror URI."""
    foreign: bool
    """Of a schema or format this runner does not read, or verified but not loadable:
    possibly good for another version, so set aside as protected."""
    local_path: Path | None = None
    """Set for a local checkpoint (a step directory or a seed file)."""
    remote: Storage | None = None
    """Set for a checkpoint in the mirror."""


@dataclass(frozen=True, kw_only=True)
class ResumePoint(Generic[T]):
    """The checkpoint a run continues from, in the run dir (downloaded there if it came from
    the mirror), and what `load` made of it."""

    checkpoint: CommittedCheckpoint
    loaded: T
    from_mirror: bool = False
    """Downloaded from the mirror (so the mirror's copy verified just now)."""
    remote: Manifest | None = None
    """The mirror's manifest as stored, for a checkpoint committed there alone (by the ranks
    of several nodes): each rank fetches the files it reads from it when it loads."""
    refused: tuple[Refusal, ...] = ()
    """Newer checkpoints that were skipped on the way to this one."""

    @property
    def step(self) -> int:
        return self.checkpoint.step

    @property
    def step_dir(self) -> Path:
        return self.checkpoint.path

    @property
    def manifest(self) -> Manifest:
        return self.checkpoint.manifest
