"""`samples.json` and `state.json`, the sidecars of one policy era (DESIGN.md, 'Run
directory'): `pivot` archives them with a timestamp and resets them (removes them), and never
touches the loss history (runner.checkpoint.loss_log)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from runner.atomicity.files import fsync_dir
from runner.checkpoint.layout import SAMPLES_FILE, STATE_FILE
from runner.errors import ConfigError

ARCHIVE_DIR = "archive"
PIVOT_SIDECARS = (SAMPLES_FILE, STATE_FILE)


def pivot(run_dir: Path, *, now: datetime | None = None) -> list[Path]:
    """Archive samples.json and state.json under RUN_DIR/archive/<timestamp>/ and reset them.

    Reset means the live files are gone: the trainer starts both afresh. loss.jsonl is never
    touched. Returns the archived paths (empty when there was nothing to archive).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    present = [run_dir / name for name in PIVOT_SIDECARS if (run_dir / name).exists()]
    if not present:
        return []
    stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S.%fZ")
    archive_root = run_dir / ARCHIVE_DIR
    archive_root.mkdir(exist_ok=True)
    target = archive_root / f"pivot-{stamp}"
    suffix = 1
    while target.exists():
        target = archive_root / f"pivot-{stamp}-{suffix}"
        suffix += 1
    target.mkdir()
    archived = []
    for src in present:
        dst = target / src.name
        os.replace(src, dst)  # same filesystem: atomic, no copy, no partial archive
        archived.append(dst)
    fsync_dir(target)
    fsync_dir(run_dir)
    return archived
