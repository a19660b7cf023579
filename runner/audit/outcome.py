"""What a finished run left, as a resume audit compares it: the newest checkpoint's fingerprint
and the loss history (loss.jsonl: a step logged twice, redone after a resume, counts its last
line)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.loss_log import LossLog
from runner.errors import IntegrityError
from runner.storage.file import FileStorage


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    fingerprint: str
    losses: dict[int, float]
    step: int = 0
    """The newest checkpoint's step."""


def outcome(run_dir: Path) -> RunOutcome:
    storage = FileStorage(run_dir)
    steps = list_checkpoints(storage)
    if not steps:
        raise IntegrityError(f"{run_dir}: the run left no checkpoint")
    manifest = read_manifest(storage, steps[-1])
    losses = LossLog(run_dir).read()
    return RunOutcome(fingerprint=manifest.fingerprint, losses=losses, step=steps[-1])


def differing_steps(a: dict[int, float], b: dict[int, float]) -> list[int]:
    """The steps whose loss differs (or that only one run logged), in order."""
    return sorted(s for s in a.keys() | b.keys() if a.get(s) != b.get(s))
