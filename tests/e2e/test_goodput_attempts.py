"""Goodput from the bucket alone, with real processes and a real S3 server (SeaweedFS): the
demo under `runner run --max-restarts 3`, its trainer SIGKILLed twice, the supervisor
SIGTERMed once, then the same command run to the end; `runner goodput --json` on the bucket
accounts for every attempt, and the steps it calls redone are the steps loss.jsonl logs twice."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.fixtures.demo_process import logged_steps
from tests.fixtures.supervised import REPO, Supervised

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 400
BADPUT = {"startup", "restore", "checkpoint_stall", "wasted_progress", "between_attempts", "other"}


def _trainer_pid(proc: Supervised, attempt: int, timeout: float = 60) -> int:
    """The trainer of `attempt`, as the supervisor logs it: its other children (short-lived
    helpers some libraries spawn) are never mistaken for the trainer."""
    pattern = re.compile(rf"started trainer pid (\d+) \(attempt {attempt}\)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(proc.stderr):
            if m := pattern.search(line):
                return int(m.group(1))
        assert proc.proc.poll() is None, proc.err
        time.sleep(0.02)
    raise AssertionError(f"the supervisor started no attempt {attempt}:\n{proc.err}")


def _wait_logged(run_dir: Path, step: int, proc: Supervised, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = logged_steps(run_dir)
        if steps and max(steps) >= step:
            return
        assert proc.proc.poll() is None, proc.err
        time.sleep(0.01)
    raise AssertionError(f"no step {step} logged in {timeout}s:\n{proc.err}")


def _goodput(location: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "runner", "goodput", location, "--json"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_two_kills_and_a_preemption_are_accounted_from_the_bucket(
    tmp_path: Path, s3_bucket: str
) -> None:
    run_dir = tmp_path / "run"
    bucket = f"s3://{s3_bucket}/goodput"
    args = [
        "--run-dir", str(run_dir), "--mirror", bucket, "--max-restarts", "3",
        "--restart-backoff", "0.2", "--steps", str(STEPS), "--ckpt-every", "25",
        "--", sys.executable, "-m", "runner", "demo", "--device", "cpu", "--threads", "1",
        "--no-progress",
    ]  # fmt: skip
    first = Supervised(args)
    try:
        for attempt, kill_at in ((1, 60), (2, 140)):  # no notice: steps since the save are lost
            trainer = _trainer_pid(first, attempt)
            _wait_logged(run_dir, kill_at, first)
            try:
                os.kill(trainer, signal.SIGKILL)
            except ProcessLookupError:
                ended = f"trainer {trainer} ended before its kill:\n{first.err}"
                raise AssertionError(ended) from None
        _trainer_pid(first, 3)
        _wait_logged(run_dir, 220, first)
        first.proc.send_signal(signal.SIGTERM)  # a preemption with notice: nothing lost
        assert first.proc.wait(timeout=120) == 75, first.err
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
            first.proc.wait()
    second = Supervised(args)
    assert second.proc.wait(timeout=300) == 0, second.err

    result = _goodput(bucket)  # the bucket alone: the run dir is not read
    badput = result["badput_seconds"]
    assert isinstance(badput, dict) and set(badput) == BADPUT
    wall = result["wall_seconds"]
    assert isinstance(wall, float) and wall > 0
    good = result["goodput_seconds"]
    assert isinstance(good, float) and good > 0
    total = good + sum(badput.values())
    assert abs(total - wall) <= 0.01 * wall, (total, wall)
    assert result["goodput_ratio"] == pytest.approx(good / wall, abs=1e-4)

    attempts = result["attempts"]
    assert isinstance(attempts, list)
    assert [a["end"] for a in attempts] == ["failed", "failed", "preempted", "finished"]
    assert [a["exit_code"] for a in attempts][2:] == [75, 0]
    assert all(a["exit_code"] not in (0, 75, None) for a in attempts[:2])
    assert attempts[0]["first_step"] == 1 and attempts[-1]["last_step"] == STEPS
    for before, after in itertools.pairwise(attempts):
        assert after["started_at"] >= before["ended_at"]  # one after the other
        assert after["first_step"] <= before["last_step"] + 1  # resumed at or before its end
    assert result["preemptions_with_notice"] == 1
    assert result["failures_without_notice"] == 2

    # the steps trained twice, read from loss.jsonl: every line of a step after its first
    trained = Counter(logged_steps(run_dir))
    assert set(trained) == set(range(1, STEPS + 1))
    redone = sum(n - 1 for n in trained.values())
    assert redone > 0
    assert result["steps_redone"] == redone
    assert badput["wasted_progress"] > 0 and badput["between_attempts"] > 0
    assert badput["startup"] > 0 and good > 0
