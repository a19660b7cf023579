"""`runner demo` on 2 ranks under real torchrun (gloo, CPU): stops and resumes.

- test_sigterm_to_torchrun_then_same_command_is_exact: SIGTERM to torchrun once a periodic
  checkpoint is committed stops every rank with exit 75; re-running the same command ends at
  the straight run's fingerprint with its loss history, step for step.
- test_sigterm_to_one_rank_stops_both_at_one_step: SIGTERM to rank 1's process alone stops
  both ranks after the same step N, with one new checkpoint at N written by both ranks.
- test_mirror_alone_resumes_exactly: with `--mirror file://...`, a run stopped by SIGTERM
  whose run dir is then deleted resumes from the mirror to the straight run's fingerprint.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.checkpoint.loss_log import LossLog
from tests.fixtures.demo_process import checkpoint_steps, logged_steps, manifest
from tests.fixtures.multirank import (
    EVERY,
    STEPS,
    Straight,
    demo_args,
    final_fingerprint,
    rank_exits,
    stops,
    wait_until,
)
from tests.fixtures.torchrun import Torchrun

pytestmark = pytest.mark.e2e

RANK_FILES = {"__0_0.distcp", "__1_0.distcp", "rank_00000.pt", "rank_00001.pt"}
SHARED_FILES = {".metadata", "train_state.pt"}


def assert_finished_like(launch: Torchrun, run_dir: Path, straight: Straight) -> None:
    assert launch.wait(180) == 0, launch.output()
    assert rank_exits(launch) == {0: 0, 1: 0}, launch.output()
    assert final_fingerprint(launch.rank_stderr(0)) == (STEPS, straight.fingerprint)
    assert manifest(run_dir, STEPS)["fingerprint"] == straight.fingerprint
    assert LossLog(run_dir).read() == straight.losses


def test_sigterm_to_torchrun_then_same_command_is_exact(
    torchrun: Callable[..., Torchrun], tmp_path: Path, straight_2rank: Straight
) -> None:
    run_dir = tmp_path / "run"
    first = torchrun(2, demo_args(run_dir))
    wait_until(lambda: bool(checkpoint_steps(run_dir)), lambda: first.proc.poll() is None,
               "periodic checkpoint")  # fmt: skip
    first.signal(signal.SIGTERM)
    # torchrun's agent re-raises the SIGTERM it forwarded (SignalException): exit 1
    assert first.wait(90) == 1, first.output()
    assert rank_exits(first) == {0: 75, 1: 75}, first.output()
    stopped = max(logged_steps(run_dir))
    assert EVERY <= stopped < STEPS
    assert checkpoint_steps(run_dir)[-1] == stopped
    assert [step for _, step in stops(first.rank_stderr(0) + first.rank_stderr(1))] == [
        stopped,
        stopped,
    ]

    again = torchrun(2, demo_args(run_dir))
    assert_finished_like(again, run_dir, straight_2rank)
    assert f"resuming from local checkpoint step {stopped}" in again.rank_stderr(0)


def test_sigterm_to_one_rank_stops_both_at_one_step(
    torchrun: Callable[..., Torchrun], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    launch = torchrun(2, demo_args(run_dir, "--keep", "100"))
    launch.worker_pids()
    wait_until(lambda: bool(checkpoint_steps(run_dir)), lambda: launch.proc.poll() is None,
               "periodic checkpoint")  # fmt: skip
    launch.signal_rank(1, signal.SIGTERM)
    # the workers exit 75, which torchrun's agent counts as a failed launch: exit 1
    assert launch.wait(90) == 1, launch.output()
    assert rank_exits(launch) == {0: 75, 1: 75}, launch.output()
    ((reason0, step0),) = stops(launch.rank_stderr(0))
    ((reason1, step1),) = stops(launch.rank_stderr(1))
    assert (reason0, reason1) == ("stop requested on another rank", "SIGTERM")
    assert step0 == step1 == max(logged_steps(run_dir))
    stopped = step0
    assert EVERY <= stopped < STEPS
    periodic = set(range(EVERY, stopped + 1, EVERY))
    assert set(checkpoint_steps(run_dir)) == periodic | {stopped}
    final = manifest(run_dir, stopped)
    assert (final["step"], final["world_size"], final["format"]) == (stopped, 2, "torch-dcp")
    listed = {str(entry["path"]) for entry in final["files"]}  # type: ignore[attr-defined]
    assert listed == RANK_FILES | SHARED_FILES


def test_mirror_alone_resumes_exactly(
    torchrun: Callable[..., Torchrun], tmp_path: Path, straight_2rank: Straight
) -> None:
    run_dir, bucket = tmp_path / "run", tmp_path / "bucket"
    command = demo_args(run_dir, "--mirror", bucket.as_uri())
    first = torchrun(2, command)
    wait_until(lambda: bool(checkpoint_steps(run_dir)), lambda: first.proc.poll() is None,
               "periodic checkpoint")  # fmt: skip
    first.signal(signal.SIGTERM)
    assert first.wait(90) == 1, first.output()
    assert rank_exits(first) == {0: 75, 1: 75}, first.output()
    stopped = max(logged_steps(run_dir))
    assert EVERY <= stopped < STEPS
    assert "durable in local + mirror" in first.rank_stderr(0)
    assert checkpoint_steps(bucket)[-1] == stopped
    shutil.rmtree(run_dir)

    again = torchrun(2, command)
    assert_finished_like(again, run_dir, straight_2rank)
    assert f"resuming from step {stopped}, downloaded from {bucket.as_uri()}" in (
        again.rank_stderr(0)
    )
