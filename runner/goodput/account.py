"""A run's wall time split into goodput and named badput, from its attempt records alone.

From the first attempt's start to the last one's end:

- `goodput`: training of the steps that survive in the final lineage, each counted once (a
  step trained again by a later attempt counts only there);
- `startup`: process start to the restore (interpreter, imports, the job's set-up);
- `restore`: finding, downloading, verifying and loading the checkpoint;
- `checkpoint_stall`: the loop blocked by saves;
- `wasted_progress`: training of steps lost to a failure without a final checkpoint (redone
  by a later attempt, or past the newest checkpoint of a last attempt that failed);
- `between_attempts`: one attempt's end to the next one's start (scheduling, a new node);
- `other`: the rest (the final upload and exit, a loop that trained no step), so that the
  buckets add up to the wall time.

Between two events that carry a step (ready, save, progress, end), the steps trained are
taken to have cost the same time each; the stall of the save that ends the interval is not
training. Time two attempts overlap (a replacement started before the old one ended) is
counted once, as the newer attempt's. Steps are compared as steps: a resume at another world
size (steps rescaled) is not told apart yet.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from runner.errors import EXIT_OK, EXIT_PREEMPTED

BADPUT_KINDS = (
    "startup",
    "restore",
    "checkpoint_stall",
    "wasted_progress",
    "between_attempts",
    "other",
)

_STEP_EVENTS = ("save", "progress")  # the loop's own points in time


@dataclass(frozen=True, kw_only=True)
class AttemptSummary:
    attempt: str
    started_at: float
    ended_at: float
    exit_code: int | None
    """None: the attempt left no end (its node vanished with its supervisor)."""
    end: str
    """finished | preempted | failed"""
    first_step: int
    """The first step it trained (the step it resumed from + 1)."""
    last_step: int
    """The last step it trained (first_step - 1 when it trained none)."""
    notice: bool
    """A stop was asked for (signal or cloud notice) before it ended."""


@dataclass(frozen=True, kw_only=True)
class Goodput:
    wall_seconds: float
    goodput_seconds: float
    goodput_ratio: float
    badput_seconds: dict[str, float]
    attempts: list[AttemptSummary] = field(default_factory=list)
    preemptions_with_notice: int = 0
    failures_without_notice: int = 0
    resumes: int = 0
    steps_redone: int = 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for row in out["attempts"]:
            row.pop("notice")
        return out


def parse_events(data: bytes) -> list[dict[str, Any]]:
    """The events of one attempt file; a torn or foreign line is skipped."""
    events = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("t"), int | float):
            events.append(record)
    return sorted(events, key=lambda e: float(e["t"]))


@dataclass
class _Attempt:
    """One attempt's events, read once."""

    id: str
    events: list[dict[str, Any]]

    def first(self, kind: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == kind), None)

    @property
    def started_at(self) -> float:
        start = self.first("start")
        return float((start or self.events[0])["t"])

    @property
    def ended_at(self) -> float:
        end = self.first("end")
        return float((end or self.events[-1])["t"])

    @property
    def exit_code(self) -> int | None:
        end = self.first("end")
        code = end.get("exit_code") if end is not None else None
        return code if isinstance(code, int) else None

    def ready(self) -> dict[str, Any] | None:
        """The restore's end: the trainer's `ready`, else the supervisor's `spawn` (a
        trainer that writes no record of its own counts as training from its start)."""
        return self.first("ready") or self.first("spawn")

    @property
    def resumed_step(self) -> int:
        ready = self.ready()
        return _int(ready.get("step")) if ready is not None else self._resolved_step

    @property
    def _resolved_step(self) -> int:
        resolve = self.first("resolve")
        return _int(resolve.get("step")) if resolve is not None else 0

    @property
    def last_step(self) -> int:
        end = self.first("end")
        ended = _int(end.get("last_step")) if end is not None else 0
        steps = [_int(e.get("step")) for e in self.events if e.get("event") in _STEP_EVENTS]
        return max([self.resumed_step, ended, *steps])

    @property
    def newest_committed(self) -> int:
        """The newest step this attempt committed (its resumed step when none)."""
        steps = [_int(e.get("step")) for e in self.events if e.get("event") == "checkpoint"]
        return max([self.resumed_step, *steps])

    @property
    def ending(self) -> str:
        code = self.exit_code
        if code == EXIT_OK:
            return "finished"
        if code == EXIT_PREEMPTED:
            return "preempted"
        return "failed"

    def points(self, until: float) -> list[tuple[float, int, float]]:
        """(t, step, stall seconds ending there) from the restore to the end, no later than
        `until` (the next attempt's start: time two attempts overlap is counted once)."""
        ready = self.ready()
        if ready is None:
            return []
        points = [(min(float(ready["t"]), until), self.resumed_step, 0.0)]
        for e in self.events:
            if e.get("event") in _STEP_EVENTS and float(e["t"]) >= points[0][0]:
                stall = _float(e.get("stall_seconds"))
                step = max(_int(e.get("step")), points[-1][1])
                points.append((min(float(e["t"]), until), step, stall))
        points.append((min(self.ended_at, until), max(self.last_step, points[-1][1]), 0.0))
        return points

    def summary(self) -> AttemptSummary:
        return AttemptSummary(
            attempt=self.id,
            started_at=self.started_at,
            ended_at=self.ended_at,
            exit_code=self.exit_code,
            end=self.ending,
            first_step=self.resumed_step + 1,
            last_step=self.last_step,
            notice=self.first("stop") is not None,
        )


def account(records: Mapping[str, bytes | Sequence[dict[str, Any]]]) -> Goodput:
    """The goodput of the attempts in `records` (attempt id -> its file's bytes or events)."""
    attempts = _read(records)
    buckets = dict.fromkeys(BADPUT_KINDS, 0.0)
    goodput = 0.0
    redone = 0
    for index, attempt in enumerate(attempts):
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        until = following.started_at if following is not None else attempt.ended_at
        startup, restore = _startup_and_restore(attempt, until)
        buckets["startup"] += startup
        buckets["restore"] += restore
        # each step of this attempt survives unless a later attempt trained it again, or it
        # is the run's last attempt and failed past its newest checkpoint
        later = [(a.resumed_step, a.last_step) for a in attempts[index + 1 :]]
        if following is None and attempt.ending == "failed":
            later.append((attempt.newest_committed, attempt.last_step))
        points = attempt.points(until)
        for (t0, s0, _), (t1, s1, stall) in itertools.pairwise(points):
            stall = min(max(stall, 0.0), max(t1 - t0, 0.0))
            buckets["checkpoint_stall"] += stall
            seconds = max(t1 - t0 - stall, 0.0)
            if s1 <= s0:
                continue  # no step trained: `other`
            kept = (s1 - s0) - _overlap(s0, s1, later)
            goodput += seconds * kept / (s1 - s0)
            buckets["wasted_progress"] += seconds * (s1 - s0 - kept) / (s1 - s0)
            redone += s1 - s0 - kept
        if following is not None:
            buckets["between_attempts"] += max(0.0, following.started_at - attempt.ended_at)
    wall = (max(a.ended_at for a in attempts) - attempts[0].started_at) if attempts else 0.0
    counted = goodput + sum(buckets.values())
    buckets["other"] = max(0.0, wall - counted)
    summaries = [a.summary() for a in attempts]
    return Goodput(
        wall_seconds=round(wall, 3),
        goodput_seconds=round(goodput, 3),
        goodput_ratio=round(goodput / wall, 6) if wall > 0 else 0.0,
        badput_seconds={k: round(v, 3) for k, v in buckets.items()},
        attempts=summaries,
        preemptions_with_notice=sum(1 for s in summaries if s.end == "preempted"),
        failures_without_notice=sum(1 for s in summaries if s.end == "failed" and not s.notice),
        resumes=sum(1 for a in attempts if a.resumed_step > 0),
        steps_redone=redone,
    )


def _read(records: Mapping[str, bytes | Sequence[dict[str, Any]]]) -> list[_Attempt]:
    attempts = []
    for attempt_id, data in records.items():
        events = parse_events(data) if isinstance(data, bytes) else list(data)
        if events:
            attempts.append(_Attempt(attempt_id, events))
    return sorted(attempts, key=lambda a: (a.started_at, a.id))


def _startup_and_restore(attempt: _Attempt, until: float) -> tuple[float, float]:
    """Process start to the restore's start, and the restore (the supervisor's search plus
    the trainer's own); an attempt that never got ready spent all of its time starting."""
    resolved = sum(_float(e.get("seconds")) for e in attempt.events if e.get("event") == "resolve")
    ready = attempt.ready()
    if ready is None:
        total = max(min(attempt.ended_at, until) - attempt.started_at, 0.0)
        return max(total - resolved, 0.0), min(resolved, total)
    restore = resolved + _float(ready.get("seconds"))
    before = max(min(float(ready["t"]), until) - attempt.started_at, 0.0)
    restore = min(restore, before)
    return before - restore, restore


def _overlap(s0: int, s1: int, spans: Iterable[tuple[int, int]]) -> int:
    """How many steps of (s0, s1] lie in the union of the (a, b] spans."""
    covered = 0
    cursor = s0
    for a, b in sorted((max(a, s0), min(b, s1)) for a, b in spans):
        if b <= a:
            continue
        a = max(a, cursor)
        if b > a:
            covered += b - a
            cursor = b
    return covered


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: object) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0
