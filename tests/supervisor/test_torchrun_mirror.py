"""The checkpoint dirs a runner child commits itself (`runner run -- runner demo`, or the demo's
ranks under `runner run -- torchrun`: the supervisor follows both the same way) are counted
and mirrored by the supervisor, which owns the mirror: a finished run's newest checkpoint is in
the bucket before `runner run` exits 0. An earlier supervisor mirrored only the seed files it
adopted, and a runner child's checkpoints only at the end of a stop."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.storage.file import FileStorage
from tests.fixtures.cli_process import runner


@pytest.mark.slow
def test_a_runner_childs_own_checkpoints_are_mirrored_before_exit_0(tmp_path: Path) -> None:
    run_dir, mirror = tmp_path / "run", tmp_path / "mirror"
    done = runner(
        "-v", "run", "--run-dir", str(run_dir), "--mirror", mirror.as_uri(), "--",
        sys.executable, "-m", "runner", "demo", "--steps", "6", "--ckpt-every", "2",
        "--device", "cpu", "--threads", "1", "--no-progress",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert list_checkpoints(FileStorage(run_dir)) == [2, 4, 6]
    assert list_checkpoints(FileStorage(mirror))[-1] == 6
    verified = runner("verify", mirror.as_uri(), "--step", "6")
    assert verified.returncode == 0, verified.stdout + verified.stderr
