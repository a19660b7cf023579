"""loss.jsonl across restarts, and `runner pivot`."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.pivot import pivot
from runner.errors import ConfigError


def _run_attempt(run_dir: Path, attempt: str, *, resume_from: int, until: int) -> None:
    with LossLog(run_dir, attempt=attempt) as log:
        log.mark_resume(resume_from)
        for step in range(resume_from + 1, until + 1):
            log.append(step, float(f"{attempt[-1]}.{step:03d}"))


def test_one_loss_per_step_on_the_surviving_path(tmp_path: Path) -> None:
    # attempt 1 checkpoints at 10 and dies at 14; attempt 2 resumes from 10 and dies at 12
    # (before writing a new checkpoint... its last checkpoint is 10 again); attempt 3 resumes
    # from 10, checkpoints at 20 and finishes at 20.
    _run_attempt(tmp_path, "a1", resume_from=0, until=14)
    _run_attempt(tmp_path, "a2", resume_from=10, until=12)
    _run_attempt(tmp_path, "a3", resume_from=10, until=20)
    got = LossLog(tmp_path).read()
    assert sorted(got) == list(range(1, 21))
    assert all(got[s] == float(f"1.{s:03d}") for s in range(1, 11))
    assert all(got[s] == float(f"3.{s:03d}") for s in range(11, 21))
    # history is kept: every line ever written is still there
    lines = [json.loads(x) for x in (tmp_path / "loss.jsonl").read_text().splitlines()]
    assert sum(1 for x in lines if "step" in x) == 14 + 2 + 10
    assert [x["resume_from"] for x in lines if "resume_from" in x] == [10, 10]
    assert all({"step", "loss", "t", "attempt"} <= x.keys() for x in lines if "step" in x)


def test_resume_that_lost_nothing_writes_no_marker(tmp_path: Path) -> None:
    _run_attempt(tmp_path, "a1", resume_from=0, until=10)
    with LossLog(tmp_path, attempt="a2") as log:
        assert log.mark_resume(10) is False
    assert "resume_from" not in (tmp_path / "loss.jsonl").read_text()


def test_resume_that_redid_nothing_still_drops_lost_steps(tmp_path: Path) -> None:
    # stopped right after resuming from 5: the lost steps 6..8 must not be reported
    _run_attempt(tmp_path, "a1", resume_from=0, until=8)
    with LossLog(tmp_path, attempt="a2") as log:
        assert log.mark_resume(5) is True
    assert sorted(LossLog(tmp_path).read()) == [1, 2, 3, 4, 5]


def test_last_line_wins_for_a_repeated_step(tmp_path: Path) -> None:
    with LossLog(tmp_path) as log:
        log.append(1, 2.0)
        log.append(2, 1.5)
        log.append(2, 1.25)
    assert LossLog(tmp_path).read() == {1: 2.0, 2: 1.25}


def test_torn_last_line_is_skipped_and_next_append_stays_valid(tmp_path: Path) -> None:
    with LossLog(tmp_path) as log:
        log.append(1, 1.0)
    with open(tmp_path / "loss.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # crash mid-write
    with LossLog(tmp_path) as log:
        log.append(2, 0.5)
    assert LossLog(tmp_path).read() == {1: 1.0, 2: 0.5}


def test_non_finite_loss_stays_valid_json(tmp_path: Path) -> None:
    with LossLog(tmp_path) as log:
        log.append(1, float("nan"))
    line = json.loads((tmp_path / "loss.jsonl").read_text())
    assert line["loss"] is None and line["loss_repr"] == "nan"


@pytest.mark.parametrize("step", [0, -1, True, 1.5])
def test_bad_step_is_refused(tmp_path: Path, step: object) -> None:
    with LossLog(tmp_path) as log, pytest.raises(ValueError):
        log.append(step, 1.0)  # type: ignore[arg-type]


def test_pivot_archives_and_resets_sidecars_never_loss(tmp_path: Path) -> None:
    _run_attempt(tmp_path, "a1", resume_from=0, until=3)
    loss_before = (tmp_path / "loss.jsonl").read_bytes()
    (tmp_path / "samples.json").write_text('{"samples": [1, 2]}')
    (tmp_path / "state.json").write_text('{"arm": "zombie"}')
    when = datetime(2026, 11, 30, 6, 0, 0, tzinfo=UTC)
    archived = pivot(tmp_path, now=when)
    target = tmp_path / "archive" / "pivot-20261130T060000.000000Z"
    assert archived == [target / "samples.json", target / "state.json"]
    assert (target / "samples.json").read_text() == '{"samples": [1, 2]}'
    assert (target / "state.json").read_text() == '{"arm": "zombie"}'
    assert not (tmp_path / "samples.json").exists()
    assert not (tmp_path / "state.json").exists()
    assert (tmp_path / "loss.jsonl").read_bytes() == loss_before
    # a second pivot at the same instant does not overwrite the first archive
    (tmp_path / "state.json").write_text("{}")
    again = pivot(tmp_path, now=when)
    assert again == [tmp_path / "archive" / "pivot-20261130T060000.000000Z-1" / "state.json"]
    assert pivot(tmp_path, now=when) == []


def test_pivot_cli(tmp_path: Path) -> None:
    (tmp_path / "loss.jsonl").write_text('{"step":1,"loss":1.0}\n')
    (tmp_path / "samples.json").write_text("[]")
    result = subprocess.run(
        [sys.executable, "-m", "runner", "pivot", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["archived"]) == 1 and out["archived"][0].endswith("/samples.json")
    assert Path(out["archived"][0]).read_text() == "[]"
    assert (tmp_path / "loss.jsonl").read_text() == '{"step":1,"loss":1.0}\n'


def test_pivot_missing_run_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        pivot(tmp_path / "nope")
    result = subprocess.run(
        [sys.executable, "-m", "runner", "pivot", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "no such run directory" in result.stderr


def test_follower_reports_the_newest_complete_step(tmp_path: Path) -> None:
    from runner.checkpoint.loss_log import LossFollower

    follower = LossFollower(tmp_path)
    assert follower.poll() is None  # no file yet
    path = tmp_path / "loss.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
    assert follower.poll() == 2  # the torn line is not counted yet
    assert follower.poll() is None  # nothing new
    with open(path, "a") as f:
        f.write('ss": 0.8}\n{"resume_from": 1}\n')
    assert follower.poll() == 3
