"""Audit fork: a new run directory that starts from one checkpoint of another run.

The fork gets its own run_id, a verified copy of the checkpoint (same payload bytes, same
fingerprint: both branches start from identical weights) and the source's loss history up to
that step, one line per step (the effective history, last line per step wins). Steps the
source's loss.jsonl lacks (a bucket holds none) come from the loss history inside the
checkpoint, marked `restored_from` as a resume marks them. Its manifest records where it came
from in `extra.forked_from`.
"""

from __future__ import annotations

import json
import logging
import math
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from runner.atomicity.files import atomic_write_bytes
from runner.checkpoint.layout import CHECKPOINTS_DIR, LOSS_FILE, checkpoint_key
from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.verify import iter_checked
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.errors import (
    ConfigError,
    IntegrityError,
    NoVerifiedCheckpointError,
    RunnerError,
    StorageNotFoundError,
)
from runner.mirror.remote_layout import to_local
from runner.storage.base import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ForkResult:
    checkpoint: CommittedCheckpoint
    run_id: str
    loss_steps: int
    skipped: list[tuple[int, str]]
    loss_restored: int = 0
    """Of `loss_steps`, how many came from the checkpoint's own loss history."""


def fork_run(
    src: Storage,
    dst: Path,
    *,
    step: int | None = None,
    writer_id: str,
    on_skip: Callable[[int, str], None] | None = None,
) -> ForkResult:
    """Copy checkpoint `step` (default: the newest that verifies) of `src` into a new run dir."""
    dst = Path(dst)
    _refuse_existing_run(dst)
    run_id = f"fork-{uuid.uuid4().hex[:12]}"
    writer = CheckpointWriter(dst / CHECKPOINTS_DIR, run_id=run_id, writer_id=writer_id)
    skipped: list[tuple[int, str]] = []
    if step is not None and step not in list_checkpoints(src):
        raise IntegrityError(f"{src.uri}: no checkpoint at step {step}")

    def skip(candidate: int, why: str) -> None:
        skipped.append((candidate, why))
        log.warning("fork: skipping step %d of %s: %s", candidate, src.uri, why)
        if on_skip is not None:
            on_skip(candidate, why)

    # the copy is the verification (every file hashed against the manifest as it is written);
    # a step the user named is not skipped but raises
    copies = iter_checked(
        src,
        partial(_copy_checkpoint, writer=writer),
        steps=None if step is None else [step],
        skip=RunnerError if step is None else (),
        on_skip=skip,
    )
    committed = next((v.value for v in copies if v.value is not None), None)
    if committed is None:
        raise NoVerifiedCheckpointError(f"{src.uri}: no checkpoint verifies; nothing to fork")
    loss_steps, restored = _copy_loss_history(src, dst, checkpoint=committed)
    return ForkResult(
        checkpoint=committed,
        run_id=run_id,
        loss_steps=loss_steps,
        skipped=skipped,
        loss_restored=restored,
    )


def _refuse_existing_run(dst: Path) -> None:
    ckpts = dst / CHECKPOINTS_DIR
    if (ckpts.is_dir() and any(ckpts.iterdir())) or (dst / LOSS_FILE).exists():
        raise ConfigError(
            f"{dst}: already holds a run (checkpoints or {LOSS_FILE}); fork into a new directory"
        )


def _copy_checkpoint(src: Storage, step: int, *, writer: CheckpointWriter) -> CommittedCheckpoint:
    remote = read_manifest(src, step)
    base = checkpoint_key(step)
    # a mirror keeps payload under a per-upload directory; the fork gets the writer's layout
    manifest = to_local(remote, source=f"{src.uri}/{base}")
    forked_from = {"location": src.uri, "run_id": manifest.run_id, "step": step}
    meta = CheckpointMeta(
        step=manifest.step,
        samples_seen=manifest.samples_seen,
        world_size=manifest.world_size,
        epoch=manifest.epoch,
        batch_in_epoch=manifest.batch_in_epoch,
        fingerprint=manifest.fingerprint,
        extra={**manifest.extra, "forked_from": forked_from},
    )
    sources = {
        f.path: partial(src.open_read, f"{base}/{r.path}")
        for f, r in zip(manifest.files, remote.files, strict=True)
    }
    expected = {f.path: (f.size, f.sha256) for f in manifest.files}
    try:
        return writer.copy_streams(sources, meta=meta, format=manifest.format, expected=expected)
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{src.uri}/{base}: a file listed in the manifest is missing") from exc


def _copy_loss_history(
    src: Storage, dst: Path, *, checkpoint: CommittedCheckpoint
) -> tuple[int, int]:
    """Write the effective loss history for steps <= the checkpoint's; returns the number of
    steps written and how many of them came from the checkpoint (the source's loss.jsonl
    lacked them)."""
    from runner.checkpoint.loss_log import LossLog

    upto = checkpoint.step
    try:
        raw = src.get_bytes(LOSS_FILE)
    except StorageNotFoundError:
        raw = b""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / LOSS_FILE).write_bytes(raw)
        entries = [e for e in LossLog(Path(tmp)).entries() if e.step <= upto]
    records: dict[int, dict[str, Any]] = {}
    for e in entries:
        record: dict[str, Any] = {"step": e.step, "loss": e.loss if e.loss == e.loss else None}
        if e.t is not None:
            record["t"] = e.t
        if e.attempt is not None:
            record["attempt"] = e.attempt
        records[e.step] = record
    restored = 0
    if any(step not in records for step in range(1, upto + 1)):
        history = _checkpoint_loss_history(checkpoint)
        source = f"checkpoint step {upto}"
        for step, loss in enumerate(history[:upto], start=1):
            if step not in records:
                records[step] = _restored_record(step, loss, source=source)
                restored += 1
        if restored:
            log.info("fork: %d loss entries restored from the checkpoint's history", restored)
    if not records:
        return 0, 0
    lines = [json.dumps(records[s], separators=(",", ":")) + "\n" for s in sorted(records)]
    atomic_write_bytes(dst / LOSS_FILE, "".join(lines).encode())
    return len(lines), restored


def _checkpoint_loss_history(checkpoint: CommittedCheckpoint) -> list[float]:
    """The loss history the checkpoint's train state carries (steps 1..N); empty for a format
    that holds none (seed-bin) or a payload that does not load."""
    from runner.checkpoint.load import load_state
    from runner.checkpoint.manifest import FORMAT_CHUNKED, FORMAT_TORCH

    if checkpoint.manifest.format not in (FORMAT_TORCH, FORMAT_CHUNKED):
        log.info(
            "fork: a %s checkpoint carries no loss history; the fork's %s has only what the "
            "source logged",
            checkpoint.manifest.format,
            LOSS_FILE,
        )
        return []
    try:
        # copy_streams hashed every file against the manifest as it wrote it; mapped, not
        # copied: only the loss list is wanted from a state that may be gigabytes
        state = load_state(checkpoint.path, manifest=checkpoint.manifest, verified=True, mmap=True)
    except RunnerError as exc:
        log.warning("fork: the checkpoint's loss history cannot be read: %s", exc)
        return []
    history = state.get("loss_history") or []
    return [float(x) for x in history]


def _restored_record(step: int, loss: float, *, source: str) -> dict[str, Any]:
    # the line LossLog.append writes for a loss rebuilt from a checkpoint (JSON has no NaN)
    value = float(loss)
    record: dict[str, Any] = {"step": step, "loss": value if math.isfinite(value) else None}
    if not math.isfinite(value):
        record["loss_repr"] = repr(value)
    record["restored_from"] = source
    return record
