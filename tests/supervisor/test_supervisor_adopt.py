"""`runner run` adopts only finished seed files (real processes, real files): a preallocated
or half-written file is never adopted or handed back, a complete one written in place is
adopted once the trainer exits, a rejected one is kept with its bytes and makes the run exit 3,
and one renamed into place is still adopted (and mirrored) while the trainer runs."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_checkpoint
from runner.storage.file import FileStorage

REPO = Path(__file__).resolve().parents[2]
WRITER = REPO / "tests" / "trainers" / "seed_writer.py"


def _run(run_dir: Path, mode: str, *extra: str, mirror: Path | None = None) -> tuple[int, str]:
    """`runner -v run -- seed_writer.py MODE`; (exit code, stdout + stderr)."""
    args = [sys.executable, "-m", "runner", "-v", "run", "--run-dir", str(run_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if mirror is not None:
        args += ["--mirror", mirror.as_uri()]
        env["TEST_MIRROR_DIR"] = str(mirror)
    proc = subprocess.run(
        [*args, "--", sys.executable, str(WRITER), mode, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _written(output: str, step: int) -> str:
    """The sha256 the trainer says it wrote for `step`."""
    match = re.search(rf"^wrote step {step} sha256 ([0-9a-f]{{64}})$", output, re.M)
    assert match, output
    return match.group(1)


def _committed_bin(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}" / f"step_{step:06d}.bin"


def _assert_committed(run_dir: Path, step: int, sha256: str) -> None:
    manifest = verify_checkpoint(FileStorage(run_dir), step)  # sizes and sha256 re-read
    assert [(f.path, f.sha256) for f in manifest.files] == [(f"step_{step:06d}.bin", sha256)]
    assert _sha(_committed_bin(run_dir, step)) == sha256


@pytest.mark.slow
def test_preallocated_file_is_adopted_only_once_filled_and_handed_back_with_its_real_bytes(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    code, out = _run(run_dir, "prealloc")
    assert code == 0, out
    # nobody took the file (right size, zeros inside) while the trainer held it open
    assert "in place: yes" in out
    real = _written(out, 10)
    assert list_checkpoints(FileStorage(run_dir)) == [10]
    _assert_committed(run_dir, 10, real)
    assert "rejected" not in out
    # and the next start hands back those bytes, never the zeros
    code, out = _run(run_dir, "report")
    assert code == 0, out
    assert f"resume {_committed_bin(run_dir, 10)} sha256 {real}" in out


@pytest.mark.slow
def test_file_renamed_into_place_but_still_open_for_writing_waits_for_its_writer(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    code, out = _run(run_dir, "rename-then-fill")
    assert code == 0, out
    assert "in place: yes" in out
    assert list_checkpoints(FileStorage(run_dir)) == [10]
    _assert_committed(run_dir, 10, _written(out, 10))


@pytest.mark.slow
def test_complete_file_written_in_place_with_a_pause_is_adopted_after_the_trainer_exits(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    code, out = _run(run_dir, "inplace")
    assert code == 0, out
    assert list_checkpoints(FileStorage(run_dir)) == [10]
    _assert_committed(run_dir, 10, _written(out, 10))
    assert "step_000010.bin was written in place (not renamed into place)" in out
    assert "rejected" not in out
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000010"]


@pytest.mark.slow
def test_bad_last_checkpoint_is_kept_with_its_bytes_and_the_run_exits_3(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, out = _run(run_dir, "bad", "7")
    assert code == 3, out
    assert "saw step_000007.bin.rejected" in out  # the trainer exits 5 unless judged meanwhile
    written = _written(out, 7)
    rejected = run_dir / "checkpoints" / "step_000007.bin.rejected"
    assert _sha(rejected) == written  # kept, byte for byte
    assert list_checkpoints(FileStorage(run_dir)) == []
    error = out[out.index("runner: error:") :]
    assert "the trainer's newest checkpoint was not adopted: step_000007.bin (" in error
    assert "disagrees with its header" in error
    assert "The newest usable checkpoint is none" in error
    assert "under a temp name in RUNNER_CKPT_DIR, close it, then rename it" in error
    assert "(checked while the trainer ran: it was renamed into place" in error
    # the same mistake again: the second file is kept too, the first one untouched
    code, out = _run(run_dir, "bad", "7")
    assert code == 3, out
    assert _sha(rejected) == written
    assert _sha(rejected.with_name("step_000007.bin.rejected.1")) == _written(out, 7)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000007.bin.rejected",
        "step_000007.bin.rejected.1",
    ]


def test_bad_final_checkpoint_after_sigterm_exits_3_not_75(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    mirror = tmp_path / "mirror"
    runner = [sys.executable, "-m", "runner", "-v", "run", "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        [*runner, "--mirror", mirror.as_uri(), "--", sys.executable, str(WRITER), "bad-on-term"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        manifest = run_dir / "checkpoints" / "step_000001" / "manifest.json"
        end = time.monotonic() + 20
        while not manifest.exists():
            assert time.monotonic() < end and proc.poll() is None, "step 1 was not adopted"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, err
    assert _sha(run_dir / "checkpoints" / "step_000002.bin.rejected") == _written(out, 2)
    assert list_checkpoints(FileStorage(run_dir)) == [1]
    assert list_checkpoints(FileStorage(mirror)) == [1]  # the previous one is in the mirror
    assert "newest checkpoint step 1 is in the mirror" in err  # not final: step 2 was bad
    assert "The newest usable checkpoint is step 1" in err


def test_renamed_file_is_adopted_and_mirrored_while_the_trainer_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    mirror = tmp_path / "mirror"
    code, out = _run(run_dir, "rename", "3", mirror=mirror)
    assert code == 0, out  # the trainer exits 5 unless it saw its checkpoint in the mirror
    assert "saw manifest.json" in out
    written = _written(out, 3)
    _assert_committed(run_dir, 3, written)
    assert verify_checkpoint(FileStorage(mirror), 3).files[0].sha256 == written


@pytest.mark.slow
def test_file_of_a_step_that_already_holds_another_good_checkpoint_is_kept_aside_exit_3(
    tmp_path: Path,
) -> None:
    import struct

    run_dir = tmp_path / "run"
    other = tmp_path / "step_000007.bin"  # step 7 with other weights, committed first
    other.write_bytes(struct.pack("<ii", 7, 64) + struct.pack("<192f", *([0.5] * 192)))
    done = subprocess.run(
        [sys.executable, "-m", "runner", "convert", str(other), str(run_dir)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    before = _sha(_committed_bin(run_dir, 7))
    code, out = _run(run_dir, "inplace", "7")
    assert code == 3, out
    assert "NOT adopted" in out and "never replaced" in out
    assert _sha(_committed_bin(run_dir, 7)) == before  # the good checkpoint stays
    (kept,) = (run_dir / "aside").iterdir()  # and the trainer's file is kept, whole
    assert _sha(kept / "step_000007.bin") == _written(out, 7)
