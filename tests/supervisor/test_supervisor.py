"""`runner run -- CMD` with real processes and real signals, supervising a trainer written in
C (no PyTorch) that writes seed-format .bin checkpoints."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.checkpoint.formats.seedbin import expected_size, read_header
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_checkpoint
from runner.storage.file import FileStorage
from tests.fixtures.metadata_server import FakeCloud
from tests.fixtures.supervised import Supervised

REPO = Path(__file__).resolve().parents[2]
N_PARAMS = 64


@pytest.fixture
def supervised() -> Iterator[list[Supervised]]:
    started: list[Supervised] = []
    yield started
    for s in started:
        s.kill()


def _start(started: list[Supervised], args: list[str], **kw: object) -> Supervised:
    s = Supervised(args, **kw)  # type: ignore[arg-type]
    started.append(s)
    return s


def _wait_for(path: Path, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} did not appear"
        time.sleep(0.02)


def _assert_adopted(run_dir: Path, step: int) -> None:
    storage = FileStorage(run_dir)
    manifest = verify_checkpoint(storage, step)
    assert manifest.format == "seed-bin"
    step_dir = run_dir / "checkpoints" / f"step_{step:06d}"
    assert [f.path for f in manifest.files] == [f"step_{step:06d}.bin"]
    header = read_header(step_dir / f"step_{step:06d}.bin")
    assert (header.step, header.n_params) == (step, N_PARAMS)
    assert header.size == expected_size(N_PARAMS) == 8 + 12 * N_PARAMS


def _loose_bins(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.bin"))


def test_signals_forwarded_sigusr1_continues_sigterm_exits_75_with_final_adopted(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    s = _start(
        supervised,
        ["--run-dir", str(run_dir), "--", str(seed_trainer), "1000000", str(N_PARAMS), "10", "0"],
    )
    s.expect(r"^started at step 0 resume=none$")
    s.expect(r"^step 3 ")
    s.proc.send_signal(signal.SIGUSR1)
    usr1_step = int(s.expect(r"^checkpoint step (\d+)$").group(1))
    _wait_for(run_dir / "checkpoints" / f"step_{usr1_step:06d}" / "manifest.json")
    s.expect(rf"^step {usr1_step + 5} ")  # kept training after the checkpoint
    assert s.proc.poll() is None
    s.proc.send_signal(signal.SIGTERM)
    s.proc.send_signal(signal.SIGTERM)  # a second SIGTERM changes nothing
    final_step = int(s.expect(r"^stopping at step (\d+)$").group(1))
    assert s.wait() == 75, s.err
    assert final_step > usr1_step + 5
    assert list_checkpoints(FileStorage(run_dir)) == [usr1_step, final_step]
    _assert_adopted(run_dir, usr1_step)
    _assert_adopted(run_dir, final_step)
    assert _loose_bins(run_dir) == []
    assert "forwarding SIGUSR1: the trainer checkpoints and continues" in s.err
    assert "SIGTERM: forwarded SIGTERM to the trainer" in s.err
    assert f"final checkpoint: step {final_step}" in s.err
    assert s.out.count("stopping at step") == 1


@pytest.mark.slow
def test_crash_restarts_and_resume_hands_back_newest_bin(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised]
) -> None:
    trainer = [str(seed_trainer), "12", str(N_PARAMS), "1", "5"]
    straight_dir = tmp_path / "straight"
    straight = _start(supervised, ["--run-dir", str(straight_dir), "--", *trainer])
    assert straight.wait() == 0, straight.err
    crashed_dir = tmp_path / "crashed"
    s = _start(
        supervised,
        ["--run-dir", str(crashed_dir), "--restart-backoff", "0.05", "--", *trainer],
        env={"TRAINER_CRASH_AT": "7"},
    )
    assert s.wait() == 0, s.err
    bin5 = crashed_dir.absolute() / "checkpoints/step_000005/step_000005.bin"
    assert re.findall(r"^started at step \d+ resume=.*$", s.out, re.M) == [
        "started at step 0 resume=none",
        f"started at step 5 resume={bin5}",
    ]
    assert "boom: simulated crash after step 7" in s.err
    assert "trainer failed (exit code 1); restart 1 of 3 in 0.05 s" in s.err
    steps = list_checkpoints(FileStorage(crashed_dir))
    assert steps == [5, 10, 12] == list_checkpoints(FileStorage(straight_dir))
    # resumed from the adopted .bin, it ends bit-identical to the uninterrupted run
    resumed = verify_checkpoint(FileStorage(crashed_dir), 12)
    assert resumed.fingerprint == verify_checkpoint(FileStorage(straight_dir), 12).fingerprint
    assert (
        resumed.files[0].sha256 == verify_checkpoint(FileStorage(straight_dir), 12).files[0].sha256
    )

    # a new supervisor on the same run dir hands back the newest checkpoint
    more = _start(
        supervised,
        ["--run-dir", str(crashed_dir), "--", str(seed_trainer), "14", str(N_PARAMS), "1", "5"],
    )
    assert more.wait() == 0, more.err
    bin12 = crashed_dir.absolute() / "checkpoints/step_000012/step_000012.bin"
    assert f"started at step 12 resume={bin12}" in more.out
    assert list_checkpoints(FileStorage(crashed_dir)) == [10, 12, 14]  # --keep 3


@pytest.mark.slow
def test_crash_loop_gives_up_after_limit_showing_last_output(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised]
) -> None:
    s = _start(
        supervised,
        [
            "--run-dir",
            str(tmp_path / "run"),
            "--max-restarts",
            "2",
            "--restart-backoff",
            "0.05",
            "--",
            str(seed_trainer),
            "100",
            str(N_PARAMS),
            "1",
            "1",
        ],
        env={"TRAINER_ALWAYS_CRASH_AT": "2"},
    )
    assert s.wait() == 1
    assert s.out.count("started at step") == 3
    assert "restart 1 of 2 in 0.05 s" in s.err
    assert "restart 2 of 2 in 0.10 s" in s.err  # exponential
    error = s.err[s.err.index("runner: error:") :]
    assert "failed 3 time(s), last with exit code 1" in error
    assert "gave up after --max-restarts 2" in error
    assert "Its last output, attempt by attempt:" in error
    assert "    boom: simulated crash after step 2" in error
    assert "    step 2 loss" in error
    # every attempt resumed from the step-1 checkpoint it had adopted
    assert s.out.count("resume=") == 3 and s.out.count("started at step 1 resume=") == 2


def test_bad_size_bin_is_rejected_and_never_adopted(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    s = _start(
        supervised,
        ["--run-dir", str(run_dir), "--", str(seed_trainer), "4", str(N_PARAMS), "1", "2"],
        env={"TRAINER_BAD_BIN_AT": "3"},
    )
    assert s.wait() == 0, s.err
    assert list_checkpoints(FileStorage(run_dir)) == [2, 4]
    rejected = run_dir / "checkpoints" / "step_000003.bin.rejected"
    assert rejected.stat().st_size == expected_size(N_PARAMS) - 4
    assert "rejected trainer checkpoint step_000003.bin" in s.err
    assert "disagrees with its header" in s.err and "NOT adopted" in s.err
    assert _loose_bins(run_dir) == []


def test_preemption_notice_stops_the_supervised_trainer(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised], fake_cloud: FakeCloud
) -> None:
    run_dir = tmp_path / "run"
    s = _start(
        supervised,
        [
            "--run-dir",
            str(run_dir),
            "--notices",
            "gcp",
            "--notice-endpoint",
            fake_cloud.url,
            "--notice-poll-seconds",
            "0.1",
            "--",
            str(seed_trainer),
            "1000000",
            str(N_PARAMS),
            "10",
            "0",
        ],
    )
    s.expect(r"^step 2 ")
    fake_cloud.gcp_preempt()
    final_step = int(s.expect(r"^stopping at step (\d+)$").group(1))
    assert s.wait() == 75, s.err
    assert list_checkpoints(FileStorage(run_dir)) == [final_step]
    _assert_adopted(run_dir, final_step)
    assert "gcp preemption notice: forwarded SIGTERM to the trainer" in s.err


def test_grace_deadline_kills_a_trainer_that_ignores_sigterm_exit_1_not_75(
    tmp_path: Path, supervised: list[Supervised]
) -> None:
    s = _start(
        supervised,
        [
            "--run-dir",
            str(tmp_path / "run"),
            "--grace-seconds",
            "0.5",
            "--",
            "sh",
            "-c",
            "trap '' TERM; echo ready; sleep 60",
        ],
    )
    s.expect("^ready$")
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(timeout=10) == 1  # not 75: nothing was committed
    assert time.monotonic() - start < 5
    assert "grace period over" in s.err
    assert "without committing any checkpoint" in s.err


def test_child_environment_and_own_process_group(
    tmp_path: Path, supervised: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    script = (
        "import os; print('env', os.environ['RUNNER_RUN_DIR'], os.environ['RUNNER_CKPT_DIR'],"
        " repr(os.environ['RUNNER_RESUME_FROM']), repr(os.environ['RUNNER_RESUME_FORMAT']));"
        " print('group', os.getpgid(0) == os.getpid(),"
        " os.getpgid(0) != os.getpgid(os.getppid()));"
        " print('passed', os.environ.get('RUNNER_NOTICE_ENDPOINT'),"
        " os.environ['RUNNER_CKPT_EVERY'])"
    )
    s = _start(
        supervised,
        ["--run-dir", str(run_dir), "--ckpt-every", "7", "--", sys.executable, "-c", script],
        # the supervisor's own settings stay with it; training settings reach the child
        env={"RUNNER_NOTICE_ENDPOINT": "http://127.0.0.1:9"},
    )
    assert s.wait() == 0, s.err
    absolute = run_dir.absolute()
    assert f"env {absolute} {absolute / 'checkpoints'} '' ''" in s.out
    assert "group True True" in s.out
    assert "passed None 7" in s.out


def test_missing_trainer_is_a_usage_error(tmp_path: Path, supervised: list[Supervised]) -> None:
    s = _start(supervised, ["--run-dir", str(tmp_path), "--", str(tmp_path / "no-such-trainer")])
    assert s.wait() == 2
    assert "cannot start the trainer" in s.err


def test_final_checkpoint_reaches_the_mirror_and_a_fresh_run_dir_resumes_from_it(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised]
) -> None:
    mirror = f"file://{tmp_path / 'bucket'}"
    first = tmp_path / "node1"
    s = _start(
        supervised,
        [
            "--run-dir",
            str(first),
            "--mirror",
            mirror,
            "--",
            str(seed_trainer),
            "1000000",
            str(N_PARAMS),
            "10",
            "0",
        ],
    )
    s.expect(r"^step 3 ")
    s.proc.send_signal(signal.SIGTERM)
    final_step = int(s.expect(r"^stopping at step (\d+)$").group(1))
    assert s.wait() == 75, s.err
    assert f"final checkpoint step {final_step} is in the mirror" in s.err
    shutil.rmtree(first)  # the node is gone with its disk

    second = tmp_path / "node2"
    more = _start(
        supervised,
        [
            "--run-dir",
            str(second),
            "--mirror",
            mirror,
            "--",
            str(seed_trainer),
            str(final_step + 2),
            str(N_PARAMS),
            "1",
            "0",
        ],
    )
    assert more.wait() == 0, more.err
    payload = second.absolute() / f"checkpoints/step_{final_step:06d}/step_{final_step:06d}.bin"
    assert f"started at step {final_step} resume={payload}" in more.out
    _assert_adopted(second, final_step + 2)


def test_corrupt_newest_checkpoint_is_skipped_and_the_previous_handed_back(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    first = _start(
        supervised,
        ["--run-dir", str(run_dir), "--", str(seed_trainer), "10", str(N_PARAMS), "1", "5"],
    )
    assert first.wait() == 0, first.err
    newest = run_dir / "checkpoints/step_000010/step_000010.bin"
    data = bytearray(newest.read_bytes())
    data[100] ^= 0x01
    newest.write_bytes(bytes(data))
    again = _start(
        supervised,
        ["--run-dir", str(run_dir), "--", str(seed_trainer), "12", str(N_PARAMS), "1", "5"],
    )
    assert again.wait() == 0, again.err
    payload = run_dir.absolute() / "checkpoints/step_000005/step_000005.bin"
    assert f"started at step 5 resume={payload}" in again.out
    assert "not resuming from step 10" in again.err and "sha256 mismatch" in again.err
    assert list_checkpoints(FileStorage(run_dir)) == [5, 10, 12]
    _assert_adopted(run_dir, 10)  # redone and committed again over the corrupt one


@pytest.mark.slow
def test_misnamed_seed_bin_is_ignored_with_one_warning(
    tmp_path: Path, supervised: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    # step_40.bin: a valid seed payload under a name with fewer than six digits
    script = (
        "import os, struct, time; d = os.environ['RUNNER_CKPT_DIR'];"
        " open(os.path.join(d, 'step_40.bin'), 'wb').write(struct.pack('<ii', 40, 1) + bytes(12));"
        " time.sleep(1.5); print('done')"
    )
    s = _start(supervised, ["--run-dir", str(run_dir), "--", sys.executable, "-c", script])
    assert s.wait() == 0, s.err
    warnings = [line for line in s.err.splitlines() if "step_40.bin" in line]
    assert len(warnings) == 1, s.err  # once per file, not at every scan
    assert "must be named step_NNNNNN.bin (six digits" in warnings[0]
    assert "step_000040.bin" in warnings[0]
    assert (run_dir / "checkpoints" / "step_40.bin").exists()  # left alone, never adopted
    assert list_checkpoints(FileStorage(run_dir)) == []


ENV_SCRIPT = (
    "import os; print('env', os.environ['RUNNER_RUN_DIR'], repr(os.environ['RUNNER_RESUME_FROM']),"
    " repr(os.environ['RUNNER_RESUME_FORMAT']))"
)


def _runner(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "RUNNER_RUN_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_run_has_its_own_default_run_dir_not_the_demos(tmp_path: Path) -> None:
    """After `runner demo` with its defaults, `runner run -- CMD` with its defaults starts
    fresh: it must not hand a trainer the demo's torch checkpoint."""
    demo = _runner(
        "demo", "--steps", "3", "--ckpt-every", "3", "--device", "cpu", "--threads", "1",
        "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    assert (tmp_path / "runs/demo/checkpoints/step_000003/manifest.json").exists()
    run = _runner("run", "--", sys.executable, "-c", ENV_SCRIPT, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"env {tmp_path / 'runs' / 'run'} '' ''" in run.stdout


@pytest.mark.slow
def test_resume_format_is_passed_and_a_seed_trainer_refuses_a_torch_checkpoint(
    tmp_path: Path, seed_trainer: Path, supervised: list[Supervised]
) -> None:
    run_dir = tmp_path / "run"
    demo = _runner(
        "demo", "--run-dir", str(run_dir), "--steps", "3", "--ckpt-every", "3", "--device",
        "cpu", "--threads", "1", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    payload = run_dir.absolute() / "checkpoints" / "step_000003" / "state.pt"
    s = _start(supervised, ["--run-dir", str(run_dir), "--", sys.executable, "-c", ENV_SCRIPT])
    assert s.wait() == 0, s.err
    assert f"{str(payload)!r} 'torch-state'" in s.out
    s = _start(
        supervised,
        ["--run-dir", str(run_dir), "--max-restarts", "0", "--", str(seed_trainer), "5",
         str(N_PARAMS), "1", "5"],
    )  # fmt: skip
    assert s.wait() == 2, s.err  # the trainer's exit 2, not restarted
    assert (
        f"cannot resume from {payload}: its format is torch-state (RUNNER_RESUME_FORMAT), "
        "and this trainer reads only seed-bin checkpoints"
    ) in s.err
    assert "started at step" not in s.out  # refused before parsing a byte of it
