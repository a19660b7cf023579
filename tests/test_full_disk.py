"""A real full disk (a 2.5 MB tmpfs): the failed save leaves the last good checkpoint intact,
no partial files, a clear message, and training goes on until the final save fails."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.checkpoint.reader import verify_dir
from tests.demo_process import checkpoint_steps, run_demo


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    # Room for one demo checkpoint (1.4 MB) but not two: the second save hits ENOSPC.
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2500k", "tmpfs", str(mount_point)], check=True
    )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_full_disk_keeps_the_last_good_checkpoint_and_says_what_to_do(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    done = run_demo(run_dir, steps=6, ckpt_every=2)
    assert done.returncode == 1, done.stderr
    assert "checkpoint at step 4 could not be written" in done.stderr
    assert "No space left on device" in done.stderr
    assert "step 2 is intact" in done.stderr
    assert "training continues" in done.stderr  # the periodic failure did not stop the run
    assert "checkpoint at step 6 could not be written" in done.stderr  # the final one failed
    assert "Traceback" not in done.stderr
    assert checkpoint_steps(run_dir) == [2]
    verify_dir(run_dir / "checkpoints" / "step_000002")
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []
