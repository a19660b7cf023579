"""Sidecar files beside the checkpoints (DESIGN.md, 'Run directory').

`loss.jsonl` is the audit trail of the whole run: append-only, never archived, never
rewritten. Each line is a JSON object; loss lines carry "step", "loss", "t" (UNIX time) and
"attempt" (the writer that produced them). When a run resumes from step S while the log
already holds steps after S (work lost with a crashed attempt), one marker line
`{"resume_from": S, "t": ..., "attempt": ...}` is appended: a reader drops every step > S
seen before the marker, so it gets exactly one loss per step, the one on the path that led to
the current state, while the lost lines stay in the file. Within that rule the last line for
a step wins. Marker lines have no "step": readers that only want losses skip such lines.

`samples.json` and `state.json` belong to one policy era: `pivot` archives them with a
timestamp and resets them (removes them), and never touches the loss history.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from runner.checkpoint.atomic import fsync_dir
from runner.checkpoint.layout import LOSS_FILE, SAMPLES_FILE, STATE_FILE
from runner.errors import ConfigError

log = logging.getLogger(__name__)

ARCHIVE_DIR = "archive"
PIVOT_SIDECARS = (SAMPLES_FILE, STATE_FILE)


@dataclass(frozen=True, slots=True)
class LossEntry:
    step: int
    loss: float
    attempt: str | None
    t: float | None


class LossLog:
    """Append-only loss history of a run dir. Not thread-safe: one writer per process."""

    def __init__(self, run_dir: Path, *, attempt: str | None = None) -> None:
        self.path = Path(run_dir) / LOSS_FILE
        self.attempt = attempt
        self._file: Any = None

    # -- writing -------------------------------------------------------------------------------
    def _open(self) -> Any:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            needs_newline = self._ends_without_newline()
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            if needs_newline:
                # A crash tore the last line; start ours on a fresh line so both stay parseable.
                self._file.write("\n")
        return self._file

    def _ends_without_newline(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() == 0:
                    return False
                f.seek(-1, os.SEEK_END)
                return f.read(1) != b"\n"
        except FileNotFoundError:
            return False

    def _write(self, record: dict[str, Any]) -> None:
        f = self._open()
        f.write(json.dumps(record, separators=(",", ":")) + "\n")
        f.flush()

    def append(self, step: int, loss: float, *, restored_from: str | None = None) -> None:
        """Record the loss of update number `step` (1-based). `restored_from` marks a line
        rebuilt from a checkpoint's loss history (the original line was lost with its disk)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"loss step must be an integer >= 1, got {step!r}")
        value = float(loss)
        if not math.isfinite(value):
            # JSON has no NaN/Infinity; keep the line valid and the fact visible.
            record: dict[str, Any] = {"step": step, "loss": None, "loss_repr": repr(value)}
        else:
            record = {"step": step, "loss": value}
        record["t"] = round(time.time(), 3)
        if self.attempt is not None:
            record["attempt"] = self.attempt
        if restored_from is not None:
            record["restored_from"] = restored_from
        self._write(record)

    def mark_resume(self, step: int) -> bool:
        """Declare that training continues from the state after `step` updates.

        Appends a supersede marker only when the log holds later steps (lost work); returns
        whether it did. Call it once at start-up, after restoring, before the first append.
        """
        if step < 0:
            raise ValueError(f"resume step must be >= 0, got {step}")
        current = self.read()
        if not any(s > step for s in current):
            return False
        lost = sorted(s for s in current if s > step)
        record: dict[str, Any] = {"resume_from": step, "t": round(time.time(), 3)}
        if self.attempt is not None:
            record["attempt"] = self.attempt
        self._write(record)
        log.info(
            "loss.jsonl: resuming from step %d supersedes steps %d..%d of an earlier attempt",
            step,
            lost[0],
            lost[-1],
        )
        return True

    def sync(self) -> None:
        """fsync the log (call before committing a checkpoint so it is at least as durable)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> LossLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------
    def entries(self) -> list[LossEntry]:
        """The effective history in step order: one entry per step, on the surviving path."""
        effective: dict[int, LossEntry] = {}
        for record in self._records():
            if "resume_from" in record and "step" not in record:
                cut = int(record["resume_from"])
                for s in [s for s in effective if s > cut]:
                    del effective[s]
                continue
            step = record.get("step")
            if isinstance(step, bool) or not isinstance(step, int):
                continue
            loss = record.get("loss")
            value = float(loss) if isinstance(loss, int | float) else float("nan")
            effective[step] = LossEntry(step, value, record.get("attempt"), record.get("t"))
        return [effective[s] for s in sorted(effective)]

    def read(self) -> dict[int, float]:
        """step -> loss, exactly one per step on the path that led to the current state."""
        return {e.step: e.loss for e in self.entries()}

    def _records(self) -> list[dict[str, Any]]:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        lines = raw.split("\n")
        records: list[dict[str, Any]] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                # A torn line (crash mid-write) is expected; it carries no committed step.
                log.warning("%s:%d: skipping unreadable line", self.path, number)
                continue
            if isinstance(record, dict):
                records.append(record)
        return records


class LossFollower:
    """Follows a loss.jsonl another process appends to (the supervisor watching its trainer):
    `poll()` returns the step of the newest complete loss line written since the last poll."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOSS_FILE
        self._offset = 0
        self._partial = b""

    def poll(self) -> int | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return None
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        newest = None
        for line in lines:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool):
                newest = step
        return newest


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
