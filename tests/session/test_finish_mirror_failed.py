"""A run that reaches its last step but cannot get its final checkpoint into the mirror
exits 1 (a scheduler retries), says where the complete local copy is, and how to push it.
The mirror is a file:// location whose directory is a regular file: every write fails
with a real OS error (ENOTDIR), no fault injection needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_checkpoint, verify_dir
from runner.storage import Storage, open_storage
from tests.fixtures.demo_process import checkpoint_steps, run_demo

REPO = Path(__file__).resolve().parents[2]


def blocked_mirror(tmp_path: Path) -> str:
    blocker = tmp_path / "bucket"
    blocker.write_bytes(b"not a directory")
    return f"file://{blocker}"


def unblock(tmp_path: Path) -> Storage:
    """The store comes back: the retry must get the checkpoint there."""
    (tmp_path / "bucket").unlink()
    (tmp_path / "bucket").mkdir()
    return open_storage(f"file://{tmp_path / 'bucket'}")


@pytest.mark.slow
def test_demo_finishing_without_its_final_checkpoint_in_the_mirror_exits_1(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    done = run_demo(run_dir, "--mirror", blocked_mirror(tmp_path), steps=10, ckpt_every=5)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "final checkpoint is NOT in file://" in out
    assert f"runner push {run_dir}" in out
    assert "Not a directory" in out and "Traceback" not in out
    assert checkpoint_steps(run_dir)[-1] == 10
    verify_dir(run_dir / "checkpoints" / "step_000010")

    # the retry a scheduler makes: nothing left to train, but the checkpoint goes up
    bucket = unblock(tmp_path)
    again = run_demo(run_dir, "--mirror", f"file://{tmp_path / 'bucket'}", steps=10, ckpt_every=5)
    assert again.returncode == 0, again.stdout + again.stderr
    assert list_checkpoints(bucket) == [10]
    verify_checkpoint(bucket, 10)


def test_supervised_trainer_finishing_without_the_mirror_exits_1(
    tmp_path: Path, seed_trainer: Path
) -> None:
    run_dir = tmp_path / "run"
    command = [
        *(sys.executable, "-m", "runner", "run", "--run-dir", str(run_dir)),
        *("--mirror", blocked_mirror(tmp_path), "--grace-seconds", "2", "--"),
        *(str(seed_trainer), "6", "64", "1", "3"),
    ]

    def supervise() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = supervise()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "checkpoint step 6 is NOT in the mirror" in out
    assert "Traceback" not in out
    verify_dir(run_dir / "checkpoints" / "step_000006")

    bucket = unblock(tmp_path)
    again = supervise()
    assert again.returncode == 0, again.stdout + again.stderr
    assert list_checkpoints(bucket)[-1] == 6
    verify_checkpoint(bucket, 6)
