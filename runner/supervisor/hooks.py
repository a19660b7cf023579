"""What the supervisor needs from the mirror and the metrics registry, as protocols: the
supervisor runs with either, both or neither."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from runner.checkpoint.writer import CommittedCheckpoint
from runner.runtime.lifecycle import ResumeSource
from runner.storage.base import Storage


class MirrorHook(ResumeSource, Protocol):
    """What the supervisor needs from the mirror (runner.mirror.Mirror fits): resume
    resolution over it (runner.runtime.lifecycle), uploads, and its `storage` (a run
    re-based at a lower step de-commits the stale steps there: runner/supervisor/rebased.py)."""

    storage: Storage

    def submit(self, ckpt: CommittedCheckpoint) -> None: ...

    def upload_now(self, ckpt: CommittedCheckpoint, *, deadline: float | None = None) -> bool: ...

    def wait_idle(self, timeout: float | None = None) -> bool: ...

    def attach_record(self, path: Path, key: str) -> None: ...

    def put_record(self, key: str, path: Path) -> None: ...


class MetricsHook(Protocol):
    """What the supervisor reports (runner.metrics.registry.RunnerMetrics fits)."""

    def checkpoint_saved(self, *, step: int, duration_s: float, size_bytes: int) -> None: ...

    def checkpoint_failed(self, stage: str) -> None: ...

    def preemption_notice(self, source: str) -> None: ...

    def resumed(self, *, steps_lost: int = 0) -> None: ...

    def train_step(self, step: int) -> None: ...

    def checkpoint_found(self, *, location: str, step: int, created_at: float) -> None: ...

    def goodput(self, *, ratio: float, badput: Mapping[str, float]) -> None: ...
