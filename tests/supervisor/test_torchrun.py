"""`runner run -- torchrun ...` with real torchrun, real workers and real signals: how each
signal reaches the workers (SIGUSR1 past torchrun, which it would kill), what torchrun's exit
code means (1 for workers that all exited 75), a crash restarted, and the kill at the end of
the grace period reaching workers in their own sessions. The workers are a small script, not
the demo (tests/e2e/test_run_torchrun.py runs the demo)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from runner.supervisor.torchrun import SHUTDOWN_TIMEOUT_ENV, Torchrun, is_torchrun
from tests.fixtures.cli_process import runner
from tests.fixtures.supervised import Supervised

WORKER = r"""
import os, signal, sys, time
rank, out, mode = os.environ["RANK"], sys.argv[1], sys.argv[2]
attempt = os.environ.get("RUNNER_ATTEMPT", "")

def note(name, text=""):
    with open(os.path.join(out, f"{name}.{rank}.{attempt}"), "w") as f:
        f.write(text)

got_usr1 = []
signal.signal(signal.SIGUSR1, lambda s, f: got_usr1.append(s))
if mode == "hang":
    signal.signal(signal.SIGTERM, lambda s, f: note("sigterm"))
if mode.startswith("stop"):  # exits 75 on a stop signal, writing no checkpoint
    def stop(signum, frame):
        note("stop", signal.Signals(signum).name)
        if mode == "stop-logged" and rank == "0":  # a step trained past the checkpoint
            with open(os.path.join(os.environ["RUNNER_RUN_DIR"], "loss.jsonl"), "a") as f:
                f.write('{"step": 3, "loss": 1.0}\n')
        sys.exit(75)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
note("env", "\n".join(f"{k}={os.environ.get(k, '')}" for k in
     ("RUNNER_RUN_LOCK_TOKEN", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "RUNNER_RUN_DIR")))
note("pid", str(os.getpid()))
end = time.monotonic() + 60
while time.monotonic() < end:
    if mode == "usr1" and got_usr1:
        note("usr1")
        sys.exit(0)
    if mode == "exit75" and time.monotonic() > end - 57:
        sys.exit(75)
    if mode == "crash-once" and time.monotonic() > end - 57:
        sys.exit(1 if attempt == "1" and rank == "1" else 0)
    time.sleep(0.02)
sys.exit(4)
"""


def _start(
    started: list[Supervised], tmp_path: Path, mode: str, *run_args: str, **env: str
) -> tuple[Supervised, Path]:
    script, out = tmp_path / "worker.py", tmp_path / "out"
    script.write_text(WORKER)
    out.mkdir(exist_ok=True)
    args = [
        "--run-dir", str(tmp_path / "run"), "--restart-backoff", "0.1", *run_args, "--",
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(script), str(out), mode,
    ]  # fmt: skip
    s = Supervised(args, env={"OMP_NUM_THREADS": "1", **env})
    started.append(s)
    return s, out


def _wait_files(out: Path, pattern: str, count: int, timeout: float = 60) -> list[Path]:
    end = time.monotonic() + timeout
    while len(found := sorted(out.glob(pattern))) < count:
        assert time.monotonic() < end, f"{pattern}: only {found}"
        time.sleep(0.05)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["torchrun", "--nproc-per-node", "2", "-m", "runner", "demo"], True),
        (["/opt/venv/bin/torchrun", "train.py"], True),
        ([sys.executable, "-m", "torch.distributed.run", "train.py"], True),
        (["python3", "-u", "-m", "torch.distributed.launch", "train.py"], True),
        ([sys.executable, "-m", "runner", "demo"], False),
        (["./train", "-m"], False),
        (["torchrun.sh"], False),
    ],
)
def test_which_commands_are_torchrun(command: list[str], expected: bool) -> None:
    assert is_torchrun(command) is expected


def test_torchruns_one_is_its_workers_code_only_when_every_failed_worker_it_ran_agrees() -> None:
    def code(workers: set[int], lines: list[str], torchrun_code: int = 1) -> int:
        launcher = Torchrun()
        launcher.workers = workers
        for line in lines:
            launcher.observe(line)
        return launcher.exit_code(torchrun_code)

    a, b = "  exitcode  : 75 (pid: 11) ", "  exitcode  : 75 (pid: 12) "
    assert code({11, 12}, [a, b]) == 75
    assert code({11, 12}, ["  exitcode  : 2 (pid: 11) "]) == 2
    assert code({11, 12}, [a, "  exitcode  : -9 (pid: 12) (SIGKILL)"]) == 1
    assert code({11, 12}, [a, "  exitcode  : 1 (pid: 12) "]) == 1
    assert code({11, 12}, ["  exitcode  : 4 (pid: 11) "]) == 1
    assert code({12}, [a]) == 1  # pid 11 was never one of its workers
    assert code({11}, []) == 1  # torchrun got the stop itself: no summary
    assert code({11, 12}, [a, b], torchrun_code=-9) == -9
    assert code({11, 12}, [a, b], torchrun_code=0) == 0


@pytest.mark.slow
def test_sigusr1_reaches_every_worker_and_torchrun_survives_it(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """SIGUSR1 right after the start, before any worker has a handler: held until they do
    (torchrun would die of it, a worker still starting too), then sent to each worker; they
    exit 0 once they got it, so torchrun exits 0. The lock token and torchrun's shutdown
    timeout (the grace period, rounded up) reach the workers through torchrun."""
    s, out = _start(supervised_launches, tmp_path, "usr1", "--grace-seconds", "41.5")
    _wait_started(s)
    s.proc.send_signal(signal.SIGUSR1)
    assert s.wait(90) == 0, s.err
    assert sorted(p.name for p in out.glob("usr1.*")) == ["usr1.0.1", "usr1.1.1"]
    for rank in (0, 1):
        env = dict(line.split("=", 1) for line in (out / f"env.{rank}.1").read_text().splitlines())
        assert len(env["RUNNER_RUN_LOCK_TOKEN"]) >= 16, env
        assert env[SHUTDOWN_TIMEOUT_ENV] == "42"
        assert env["RUNNER_RUN_DIR"] == str((tmp_path / "run").absolute())
    assert "forwarding SIGUSR1 to 2 torchrun worker(s)" in s.err
    assert s.err.count("started trainer pid") == 1


def _wait_started(s: Supervised, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while "started trainer pid" not in s.err:
        assert time.monotonic() < end, s.err
        time.sleep(0.02)


@pytest.mark.slow
def test_a_shutdown_timeout_the_user_set_is_kept(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    s, out = _start(supervised_launches, tmp_path, "exit75", **{SHUTDOWN_TIMEOUT_ENV: "7"})
    assert s.wait(90) == 75, s.err
    assert f"{SHUTDOWN_TIMEOUT_ENV}=7" in (out / "env.0.1").read_text()


@pytest.mark.slow
def test_workers_that_all_exit_75_end_the_run_with_75_not_a_restart(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """torchrun exits 1 with its failure summary; both workers exited 75: passed on."""
    s, _ = _start(supervised_launches, tmp_path, "exit75", "--max-restarts", "3")
    assert s.wait(90) == 75, s.err
    assert "exitcode  : 75" in s.err  # torchrun's own summary, passed through
    assert "torchrun exited 1 because its workers exited 75" in s.err
    assert "trainer exited 75 on its own (preempted); passing it on" in s.err
    assert s.err.count("started trainer pid") == 1


@pytest.mark.slow
def test_a_worker_crash_restarts_torchrun(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """Rank 1 exits 1 in the first attempt: torchrun exits 1, restarted; the second one
    finishes."""
    s, out = _start(supervised_launches, tmp_path, "crash-once", "--max-restarts", "2")
    assert s.wait(120) == 0, s.err
    assert s.err.count("started trainer pid") == 2
    assert sorted(p.name for p in out.glob("pid.*")) == ["pid.0.1", "pid.0.2", "pid.1.1", "pid.1.2"]


@pytest.mark.slow
def test_workers_that_ignore_the_stop_are_killed_at_the_deadline(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """The workers ignore SIGTERM; torchrun's own SIGKILL would come 30 s later (the user set
    that): the supervisor kills each worker's session and torchrun at its deadline, and with
    no final checkpoint the run exits 1."""
    s, out = _start(
        supervised_launches,
        tmp_path,
        "hang",
        "--grace-seconds",
        "4",
        **{SHUTDOWN_TIMEOUT_ENV: "30"},
    )
    pids = [int(p.read_text()) for p in _wait_files(out, "pid.*", 2)]
    time.sleep(0.5)  # past the handler's installation
    sent = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait(60) == 1, s.err
    took = time.monotonic() - sent
    assert 4 <= took < 12, took
    assert sorted(p.name for p in out.glob("sigterm.*")) == ["sigterm.0.1", "sigterm.1.1"]
    assert "grace period over and the trainer is still running" in s.err
    assert not [pid for pid in pids if _alive(pid)]


@pytest.mark.slow
def test_sigint_reaches_every_worker_as_sigint_through_torchrun(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """SIGINT to the supervisor goes to torchrun, which passes SIGINT on to each worker. The
    workers exit 75 without a checkpoint: no final one stands, so the run exits 1."""
    s, out = _start(supervised_launches, tmp_path, "stop")
    _wait_files(out, "pid.*", 2)
    time.sleep(0.5)  # past the handlers' installation
    s.proc.send_signal(signal.SIGINT)
    assert s.wait(60) == 1, s.err
    assert {p.name: p.read_text() for p in out.glob("stop.*")} == {
        "stop.0.1": "SIGINT",
        "stop.1.1": "SIGINT",
    }
    assert "SIGINT: forwarded SIGINT to the trainer" in s.err
    assert "trainer stopped (exit code 1) without committing any checkpoint" in s.err


def _stop_after_resume(
    supervised_launches: list[Supervised], tmp_path: Path, mode: str, *, loss_log: bool = True
) -> Supervised:
    """A run dir with step 2 committed by a lone `runner demo` (loss.jsonl logs steps 1-2),
    then `runner run -- torchrun` on it, whose workers exit 75 on the SIGTERM torchrun passes
    on, without training or saving anything."""
    run_dir = tmp_path / "run"
    demo = runner(
        "demo", "--run-dir", str(run_dir), "--steps", "2", "--ckpt-every", "2",
        "--device", "cpu", "--threads", "1", "--no-progress",
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr
    if not loss_log:
        (run_dir / "loss.jsonl").unlink()
    s, out = _start(supervised_launches, tmp_path, mode)
    _wait_files(out, "pid.*", 2)
    s.proc.send_signal(signal.SIGTERM)
    return s


@pytest.mark.slow
def test_ranks_stopped_while_resuming_exit_75_though_torchrun_exits_1(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """torchrun got the stop itself: no failure summary, exit 1 whatever its workers did. The
    checkpoint resumed from holds every step the loss log has: it is the final one, 75."""
    s = _stop_after_resume(supervised_launches, tmp_path, "stop")
    assert s.wait(60) == 75, s.err
    assert "final (already committed before the stop) checkpoint: step 2" in s.err


@pytest.mark.slow
def test_a_step_logged_past_the_checkpoint_makes_the_stop_exit_1(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """Rank 0 logs step 3 before it exits: that step is lost, no final checkpoint stands."""
    s = _stop_after_resume(supervised_launches, tmp_path, "stop-logged")
    assert s.wait(60) == 1, s.err
    assert "steps up to 3 it logged after it are lost" in s.err


@pytest.mark.slow
def test_without_a_loss_log_torchruns_1_after_a_stop_is_not_taken_as_clean(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """Nothing says what the workers did since the checkpoint: 1, as for any trainer that
    exits 1 on a stop without committing a final checkpoint."""
    s = _stop_after_resume(supervised_launches, tmp_path, "stop", loss_log=False)
    assert s.wait(60) == 1, s.err
    assert "without committing a final checkpoint" in s.err
