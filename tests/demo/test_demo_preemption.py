"""`runner demo` as a real process receiving real signals (SIGTERM, SIGKILL, SIGUSR1): what
it commits, its exit code, and the resume that follows."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.verify import verify_dir
from tests.fixtures.demo_process import (
    DEMO_STEPS,
    checkpoint_steps,
    manifest,
    run_demo,
    start_demo,
    wait_for_step,
)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, float]]:
    """Fingerprint and loss history of an uninterrupted run."""
    run_dir = tmp_path_factory.mktemp("straight")
    done = run_demo(run_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert checkpoint_steps(run_dir)[-1] == DEMO_STEPS
    return str(manifest(run_dir, DEMO_STEPS)["fingerprint"]), LossLog(run_dir).read()


@pytest.mark.slow
def test_sigterm_commits_final_checkpoint_exits_75_and_resume_is_exact(
    tmp_path: Path, straight_run: tuple[str, dict[int, float]]
) -> None:
    stop_at = random.randint(5, DEMO_STEPS // 2)  # margin: a fast machine runs on meanwhile
    proc = start_demo(tmp_path)
    wait_for_step(proc, tmp_path, stop_at)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    reached = max(LossLog(tmp_path).read())
    assert checkpoint_steps(tmp_path)[-1] == reached, f"SIGTERM at {stop_at}: {out}"
    verify_dir(tmp_path / "checkpoints" / f"step_{reached:06d}")
    assert "final checkpoint durable in local" in out

    done = run_demo(tmp_path)
    assert done.returncode == 0, done.stderr
    fingerprint, losses = straight_run
    assert manifest(tmp_path, DEMO_STEPS)["fingerprint"] == fingerprint
    assert LossLog(tmp_path).read() == losses


@pytest.mark.slow
def test_sigkill_resumes_from_last_periodic_checkpoint(
    tmp_path: Path, straight_run: tuple[str, dict[int, float]]
) -> None:
    proc = start_demo(tmp_path)
    wait_for_step(proc, tmp_path, 27)  # past the periodic checkpoint at 20
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert checkpoint_steps(tmp_path)[-1] in (20, 40)

    done = run_demo(tmp_path)
    assert done.returncode == 0, done.stderr
    fingerprint, losses = straight_run
    assert manifest(tmp_path, DEMO_STEPS)["fingerprint"] == fingerprint
    # steps redone after the resume supersede the lost ones: one loss per step, the straight ones
    assert LossLog(tmp_path).read() == losses


@pytest.mark.slow
def test_sigusr1_checkpoints_and_keeps_training(tmp_path: Path) -> None:
    proc = start_demo(tmp_path, steps=2000, ckpt_every=0)
    try:
        wait_for_step(proc, tmp_path, 5)
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 60
        while not checkpoint_steps(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.01)
        saved = checkpoint_steps(tmp_path)
        assert len(saved) == 1 and saved[0] >= 5
        reached = wait_for_step(proc, tmp_path, saved[0] + 5)
        assert proc.poll() is None, "SIGUSR1 must not stop training"
        assert reached >= saved[0] + 5
        assert manifest(tmp_path, saved[0])["extra"] == {"reason": "SIGUSR1"}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert proc.returncode == 75


@pytest.mark.slow
def test_repeated_sigterm_still_commits_a_verified_final_checkpoint(tmp_path: Path) -> None:
    proc = start_demo(tmp_path)
    wait_for_step(proc, tmp_path, 10)
    for _ in range(5):
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    newest = checkpoint_steps(tmp_path)[-1]
    verify_dir(tmp_path / "checkpoints" / f"step_{newest:06d}")


@pytest.mark.slow
def test_finished_run_rerun_is_a_no_op(tmp_path: Path) -> None:
    first = run_demo(tmp_path, steps=10, ckpt_every=5)
    assert first.returncode == 0, first.stderr
    again = run_demo(tmp_path, steps=10, ckpt_every=5)
    assert again.returncode == 0, again.stderr
    assert checkpoint_steps(tmp_path)[-1] == 10
    assert max(LossLog(tmp_path).read()) == 10


def test_bad_option_is_a_usage_error(tmp_path: Path) -> None:
    done = subprocess.run(
        ["runner", "demo", "--run-dir", str(tmp_path), "--keep", "1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "--keep must be >= 2" in done.stderr


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_and_is_replaced_by_a_good_one(
    tmp_path: Path, straight_run: tuple[str, dict[int, float]]
) -> None:
    first = run_demo(tmp_path, steps=40)
    assert first.returncode == 0, first.stderr
    payload = tmp_path / "checkpoints" / "step_000040" / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))

    done = run_demo(tmp_path)
    assert done.returncode == 0, done.stderr
    assert "not resuming from step 40" in done.stderr and "sha256 mismatch" in done.stderr
    assert "resumed from" in done.stderr and "step_000020" in done.stderr
    fingerprint, losses = straight_run
    assert manifest(tmp_path, DEMO_STEPS)["fingerprint"] == fingerprint
    verify_dir(tmp_path / "checkpoints" / "step_000040")  # redone and committed again
    assert LossLog(tmp_path).read() == losses
