"""The goodput account on attempt records written by hand: every bucket exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from runner.goodput.account import BADPUT_KINDS, account
from runner.goodput.history import local_records, pull_records, records_at
from runner.goodput.records import AttemptLog
from runner.metrics.registry import RunnerMetrics
from runner.storage import open_storage


def _lines(*events: dict[str, object]) -> bytes:
    return b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in events)


# attempt a: starts at 0, ready at 10 (restore 2 s), checkpoints step 10 at 30 (stall 1 s) and
# step 20 at 50, killed at 60 having trained to step 25; b: starts at 70, resolves for 3 s,
# ready at 80 at step 20, stopped with a checkpoint of step 40 at 120 (stall 2 s), exits 75 at
# 125; c: starts at 130, ready at 135 at step 40, ends at step 50 at 155.
A = _lines(
    {"event": "start", "t": 0},
    {"event": "ready", "t": 10, "seconds": 2, "step": 0},
    {"event": "save", "t": 30, "step": 10, "stall_seconds": 1},
    {"event": "checkpoint", "t": 30.5, "step": 10, "background_seconds": 0.5},
    {"event": "save", "t": 50, "step": 20, "stall_seconds": 0},
    {"event": "checkpoint", "t": 51, "step": 20, "background_seconds": 1},
    {"event": "end", "t": 60, "exit_code": -9, "last_step": 25},
)
B = _lines(
    {"event": "start", "t": 70},
    {"event": "resolve", "t": 73, "seconds": 3, "step": 20},
    {"event": "spawn", "t": 73, "step": 20},
    {"event": "ready", "t": 80, "seconds": 1, "step": 20},
    {"event": "stop", "t": 118, "reason": "SIGTERM", "notice": True},
    {"event": "save", "t": 120, "step": 40, "stall_seconds": 2},
    {"event": "checkpoint", "t": 120, "step": 40},
    {"event": "end", "t": 125, "exit_code": 75, "last_step": 40},
)
C = _lines(
    {"event": "start", "t": 130},
    {"event": "ready", "t": 135, "seconds": 1, "step": 40},
    {"event": "save", "t": 155, "step": 50, "stall_seconds": 0},
    {"event": "checkpoint", "t": 155, "step": 50},
    {"event": "end", "t": 155, "exit_code": 0, "last_step": 50},
)


def test_each_bucket_of_a_killed_a_preempted_and_a_finished_attempt() -> None:
    result = account({"c": C, "a": A, "b": B})  # ordered by start, not by name
    assert result.wall_seconds == 155
    # a: 10 s to step 10 (1 of it stalled) + 20 s to step 20, then 10 s to step 25, redone
    # b: 38 s for steps 21-40, c: 20 s for 41-50
    assert result.goodput_seconds == pytest.approx(19 + 20 + 38 + 20)
    assert result.badput_seconds == pytest.approx(
        {
            "startup": (10 - 2) + (80 - 70 - 4) + (135 - 130 - 1),
            "restore": 2 + 4 + 1,
            "checkpoint_stall": 1 + 2,
            "wasted_progress": 10,
            "between_attempts": 10 + 5,
            "other": 5,  # b's final upload and exit
        }
    )
    assert result.goodput_seconds + sum(result.badput_seconds.values()) == pytest.approx(155)
    assert result.steps_redone == 5
    assert (result.preemptions_with_notice, result.failures_without_notice) == (1, 1)
    assert result.resumes == 2
    rows = [(a.attempt, a.end, a.exit_code, a.first_step, a.last_step) for a in result.attempts]
    assert rows == [
        ("a", "failed", -9, 1, 25),
        ("b", "preempted", 75, 21, 40),
        ("c", "finished", 0, 41, 50),
    ]
    assert list(result.to_json()["badput_seconds"]) == list(BADPUT_KINDS)


def test_an_attempt_that_left_no_end_counts_to_its_last_event_and_a_torn_line_is_skipped() -> None:
    torn = A.rsplit(b"\n", 2)[0] + b'\n{"event": "end", "t": 6'  # the end torn by the kill
    result = account({"a": torn, "c": C})
    (first, _) = result.attempts
    assert (first.exit_code, first.end, first.ended_at, first.last_step) == (None, "failed", 51, 20)
    # steps 1-20 survive (c resumed at 40 without retraining them)
    assert result.steps_redone == 0


def test_overlapping_attempts_count_their_common_time_once() -> None:
    # c's replacement starts at 150 while c still runs to 155: wall 155 - 130 + ...
    d = _lines(
        {"event": "start", "t": 150},
        {"event": "ready", "t": 152, "seconds": 0, "step": 40},
        {"event": "save", "t": 170, "step": 60, "stall_seconds": 0},
        {"event": "end", "t": 170, "exit_code": 0, "last_step": 60},
    )
    result = account({"c": C, "d": d})
    assert result.wall_seconds == 40
    total = result.goodput_seconds + sum(result.badput_seconds.values())
    assert total == pytest.approx(40)
    assert result.steps_redone == 10  # c's steps 41-50, trained again by d


def test_a_last_attempt_that_failed_loses_its_steps_past_its_newest_checkpoint() -> None:
    result = account({"a": A})  # killed at step 25, newest checkpoint 20, no attempt after
    assert result.steps_redone == 5
    assert result.badput_seconds["wasted_progress"] == pytest.approx(10)
    assert result.goodput_seconds == pytest.approx(19 + 20)


def test_records_are_pulled_from_a_mirror_and_counted_in_the_metrics(tmp_path: Path) -> None:
    bucket = open_storage(f"file://{tmp_path / 'bucket'}")
    bucket.put_bytes("attempts/a.jsonl", A)
    bucket.put_bytes("attempts/b.jsonl", B)
    run_dir = tmp_path / "run"
    log = AttemptLog(run_dir, "c")
    for line in C.splitlines():
        event = json.loads(line)
        log.event(event.pop("event"), **event)
    assert pull_records(bucket, run_dir) == 2
    assert pull_records(bucket, run_dir) == 0  # nothing newer the second time
    assert set(local_records(run_dir)) == {"a", "b", "c"}
    assert records_at(open_storage(str(run_dir))) == {"a": A, "b": B, "c": C}
    metrics = RunnerMetrics(CollectorRegistry())
    result = account(local_records(run_dir))
    metrics.goodput(ratio=result.goodput_ratio, badput=result.badput_seconds)
    text = generate_latest(metrics.registry).decode()
    assert f"runner_goodput_ratio {result.goodput_ratio}" in text
    assert 'runner_badput_seconds_total{kind="wasted_progress"} 10.0' in text


def test_a_failed_append_is_counted_and_never_raises(tmp_path: Path) -> None:
    (tmp_path / "attempts").write_text("not a directory")
    failures: list[int] = []
    log = AttemptLog(tmp_path, "x", on_failure=lambda: failures.append(1))
    log.event("start")
    log.save(step=1, stall_seconds=0.1)
    assert len(failures) == 2 and log.failures == 2
