"""Commit a trainer's own file or directory as a `files` checkpoint (formats/files.py): every
file copied into the staging dir and hashed as it is written, then the tree listed again, and
committed only when nothing in it changed meanwhile. Shared by `runner run --adopt` and the
framework integrations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.checkpoint.formats.files import KIND_KEY, SOURCE_KEY, TreeFile, list_tree, signature
from runner.checkpoint.manifest import FORMAT_FILES
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.errors import RunnerError


class TreeChangedError(RunnerError):
    """The tree changed while it was being copied: nothing was committed."""


def commit_tree(
    writer: CheckpointWriter,
    path: Path,
    *,
    step: int,
    source: str,
    files: list[TreeFile] | None = None,
    extra: dict[str, Any] | None = None,
    fingerprint: str = "",
) -> CommittedCheckpoint:
    """Commit `path` (its `files`, listed now when not given) as checkpoint `step`, restored
    later to `source` (relative to the trainer's working directory). `fingerprint`: what the
    caller knows of the state inside (an integration: the weights'). FileNotFoundError when
    part of it vanished, TreeChangedError when it changed while copied; nothing committed."""
    files = list_tree(path) if files is None else files
    meta = CheckpointMeta(
        step=step,
        samples_seen=0,
        world_size=1,
        epoch=0,
        batch_in_epoch=0,
        fingerprint=fingerprint,
        extra={
            SOURCE_KEY: source,
            KIND_KEY: "dir" if path.is_dir() else "file",
            **(extra or {}),
        },
    )
    with writer.staging(step) as stage:
        for f in files:
            stage.copy_in(f.rel, f.path)
        if signature(list_tree(path)) != signature(files):
            raise TreeChangedError(f"{path} changed while it was copied")
        return writer.commit(stage, meta=meta, format=FORMAT_FILES)
