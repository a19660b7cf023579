"""The loss log, `loss.jsonl` beside the checkpoints (DESIGN.md, 'Run directory').

`loss.jsonl` is the audit trail of the whole run: append-only, never archived, never
rewritten. Each line is a JSON object; loss lines carry "step", "loss", "t" (UNIX time) and
"attempt" (the writer that produced them). When a run resumes from step S while the log
already holds steps after S (work lost with a crashed attempt), one marker line
`{"resume_from": S, "t": ..., "attempt": ...}` is appended: a reader drops every step > S
seen before the marker, so it gets exactly one loss per step, the one on the path that led to
the current state, while the lost lines stay in the file. Within that rule the last line for
a step wins. Marker lines have no "step": readers that only want losses skip such lines.

The other sidecars, `samples.json` and `state.json`, are archived and reset by
runner.checkpoint.pivot, which never touches the loss history.

Long (about 330 lines): `LossLog` is the one writer of loss.jsonl (appends, resume markers,
write failures held and retried) and its reader and follower share its line format.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.checkpoint.layout import LOSS_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LossEntry:
    step: int
    loss: float
    attempt: str | None
    t: float | None


class LossLog:
    """Append-only loss history of a run dir. Not thread-safe: one writer per process.

    Writing never raises OSError and never leaves a torn line of its own: a failed append
    (disk full, I/O error) cuts the file back to where that append began, keeps its lines in
    memory (up to `MAX_PENDING`) and writes them, in order, before the next line once the disk
    takes writes again. It is reported once per failure streak in the log, once more on
    recovery, and at every failed attempt through `on_failure` (the session counts it in
    `runner_checkpoint_failures_total{stage="loss_log"}`). Training and checkpoints go on:
    the checkpoint carries the loss history too, so a line given up on is restored on resume.
    """

    MAX_PENDING = 100_000  # lines held while the disk is full (~10 MB); the oldest go first

    def __init__(
        self,
        run_dir: Path,
        *,
        attempt: str | None = None,
        on_failure: Callable[[], None] | None = None,
        writes: bool = True,
    ) -> None:
        """`writes=False`: a reader only (a rank that leaves the loss history to the primary);
        appends, resume markers and syncs then do nothing."""
        self.path = Path(run_dir) / LOSS_FILE
        self.attempt = attempt
        self.writes = writes
        self._on_failure = on_failure
        self._fd: int | None = None
        self._needs_newline = False
        self._torn_at: int | None = None  # a failed append that could not be cut back yet
        self._pending: deque[bytes] = deque()
        self._failing_since: float | None = None
        self._failed_attempts = 0
        self._dropped = 0
        # a resume at another world size: the history's length when it was loaded
        self._history_logged: int | None = None

    @property
    def pending_lines(self) -> int:
        """Lines not yet in the file (the disk refused them); written with the next append."""
        return len(self._pending)

    # -- writing -------------------------------------------------------------------------------
    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            # A crash tore the last line: ours start on a fresh line so both stay parseable
            # (a reader skips the torn one).
            self._needs_newline = _ends_without_newline(fd)
            self._fd = fd
        return self._fd

    def _write(self, record: dict[str, Any]) -> bool:
        """Append one line (after any the disk refused before); False when it is pending."""
        if not self.writes:
            return True
        if len(self._pending) >= self.MAX_PENDING:
            self._pending.popleft()
            self._dropped += 1
        self._pending.append((json.dumps(record, separators=(",", ":")) + "\n").encode())
        try:
            self._flush_pending()
        except OSError as exc:
            self._failed(exc)
            return False
        self._recovered()
        return True

    def _flush_pending(self) -> None:
        fd = self._open()
        if self._torn_at is not None:
            os.ftruncate(fd, self._torn_at)  # the part of a failed append that reached the file
            self._torn_at = None
        data = (b"\n" if self._needs_newline else b"") + b"".join(self._pending)
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            # No torn line: cut back to where this append began (freeing space never needs
            # space); if even that fails, before the next append.
            try:
                os.ftruncate(fd, start)
            except OSError:
                self._torn_at = start
            raise
        self._needs_newline = False
        self._pending.clear()

    def _failed(self, exc: OSError) -> None:
        self._failed_attempts += 1
        if self._on_failure is not None:
            self._on_failure()
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            from runner.checkpoint.oserror_advice import oserror_advice

            log.error(
                "%s: could not append (%s); the lines are kept in memory and written once it "
                "takes writes again, training and checkpoints go on. %s",
                self.path,
                exc.strerror or exc,
                oserror_advice(exc, place="on that disk", alternative=None),
            )

    def _recovered(self) -> None:
        if self._failing_since is None:
            return
        kept = (
            f"the held lines are written, except {self._dropped} older one(s) that did not "
            "fit in memory (the checkpoints still carry the loss history)"
            if self._dropped
            else "every held line is written, nothing lost"
        )
        log.warning(
            "%s: appending again after %d failed attempt(s) over %.1f s; %s",
            self.path,
            self._failed_attempts,
            time.monotonic() - self._failing_since,
            kept,
        )
        self._failing_since = None
        self._failed_attempts = 0
        self._dropped = 0

    def follow_history(self, length: int) -> None:
        """After a resume at another world size the loss history's index is no step of this
        run: `append_newest` then appends each entry past `length` as it comes."""
        self._history_logged = length

    def append_newest(self, step: int, history: Sequence[float]) -> None:
        """The loss of the step just taken (the newest in `history`), once."""
        if self._history_logged is None:  # the history's index is the step
            if history and len(history) >= step:
                self.append(step, history[step - 1])
        elif len(history) > self._history_logged:
            self.append(step, history[-1])
            self._history_logged = len(history)

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
        if not self.writes:
            return False
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
        """fsync the log (call before committing a checkpoint so it is at least as durable).
        Never raises: a failure is reported like a failed append."""
        if self._fd is None and not self._pending:
            return
        try:
            if self._pending or self._torn_at is not None:
                self._flush_pending()
            os.fsync(self._open())
        except OSError as exc:
            self._failed(exc)
            return
        self._recovered()

    def close(self) -> None:
        if self._fd is None and not self._pending:
            return
        if self._pending or self._torn_at is not None:
            with contextlib.suppress(OSError):
                self._flush_pending()
            if self._pending:
                log.error(
                    "%s: %d line(s) could not be written before closing (disk full?); the "
                    "checkpoints carry the loss history, so a resume restores them",
                    self.path,
                    len(self._pending),
                )
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._pending.clear()

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


def _ends_without_newline(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


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
