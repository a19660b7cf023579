"""One writer per run dir (runner/runtime/runlock.py), with real processes: a second `runner demo` /
`runner run` / TrainSession on a run dir in use exits 2 at once naming the holder, the first is
unaffected, a SIGKILLed holder frees it at once, and `runner run -- runner demo` works under
its supervisor's lock."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.checkpoint.loss_log import LossLog
from runner.config import RunConfig
from runner.errors import EXIT_USAGE, RunDirLockedError, exit_code_for
from runner.runtime import runlock
from runner.session.train_session import TrainSession
from tests.fixtures.demo_process import (
    checkpoint_steps,
    demo_cmd,
    manifest,
    run_demo,
    start_demo,
    wait_for_step,
)

REPO = Path(__file__).resolve().parents[2]
STEPS = 120
CKPT_EVERY = 20
HOST = socket.gethostname()
# The lock's holder, until told to go: prints its token once it holds the lock.
HOLDER = (
    "import sys; from pathlib import Path; from runner.runtime import runlock\n"
    "lock = runlock.acquire(Path(sys.argv[1]), command='test holder')\n"
    "print(lock.token, flush=True)\n"
    "sys.stdin.read()\n"
)


def _env() -> dict[str, str]:
    # a RUNNER_* setting of the calling shell must not steer these processes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_")}
    return {**env, "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same demo run with nothing else on its run dir."""
    run_dir = tmp_path_factory.mktemp("alone") / "run"
    done = run_demo(run_dir, steps=STEPS, ckpt_every=CKPT_EVERY)
    assert done.returncode == 0, done.stderr
    return run_dir


def _holder_record(run_dir: Path) -> dict[str, object] | None:
    try:
        record = json.loads((run_dir / runlock.LOCK_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    assert isinstance(record, dict)
    return record


def _wait_for_holder(run_dir: Path, pid: int, timeout: float = 30.0) -> float:
    """Seconds until the lock file names `pid` as its holder."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        record = _holder_record(run_dir)
        if record is not None and record.get("pid") == pid:
            return time.monotonic() - start
        time.sleep(0.005)
    raise AssertionError(f"pid {pid} did not take the lock of {run_dir} in {timeout}s")


def _timed(cmd: list[str], **kw: object) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=_env(), **kw)  # type: ignore[call-overload]
    return done, time.monotonic() - started


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_second_demo_exits_2_at_once_naming_the_first_which_ends_as_if_alone(
    tmp_path: Path, alone: Path
) -> None:
    run_dir = tmp_path / "run"
    first = start_demo(run_dir, steps=STEPS, ckpt_every=CKPT_EVERY)
    try:
        wait_for_step(first, run_dir, 5)
        second, took = _timed(demo_cmd(run_dir, steps=STEPS, ckpt_every=CKPT_EVERY))
        assert second.returncode == EXIT_USAGE, second.stderr
        assert took < 1.0, f"the second demo took {took:.2f}s to give up"
        assert f"run dir {run_dir} is in use by pid {first.pid} on host {HOST}" in second.stderr
        assert "(runner demo, started 20" in second.stderr
        assert "use another --run-dir" in second.stderr
        assert "Traceback" not in second.stderr
        # a supervisor is refused the same way, before it starts its trainer
        marker = tmp_path / "trainer-ran"
        run, took = _timed(
            [sys.executable, "-m", "runner", "run", "--run-dir", str(run_dir), "--",
             sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        )  # fmt: skip
        assert run.returncode == EXIT_USAGE, run.stderr
        assert took < 1.0, f"runner run took {took:.2f}s to give up"
        assert f"in use by pid {first.pid} on host {HOST}" in run.stderr
        assert not marker.exists()
        out, _ = first.communicate(timeout=120)
    finally:
        _stop(first)
    assert first.returncode == 0, out
    # the first run is exactly the run that was alone: state, checkpoints and loss history
    assert checkpoint_steps(run_dir) == checkpoint_steps(alone)
    assert manifest(run_dir, STEPS)["fingerprint"] == manifest(alone, STEPS)["fingerprint"]
    assert LossLog(run_dir).read() == LossLog(alone).read()
    lines = [json.loads(x) for x in (run_dir / "loss.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))  # one writer, no interleaving
    assert len({x["attempt"] for x in lines}) == 1


@pytest.mark.slow
def test_sigkilled_holder_frees_the_run_dir_at_once_and_the_next_start_resumes(
    tmp_path: Path, alone: Path
) -> None:
    run_dir = tmp_path / "run"
    first = start_demo(run_dir, steps=STEPS, ckpt_every=CKPT_EVERY)
    try:
        wait_for_step(first, run_dir, 2 * CKPT_EVERY + 5)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    assert _holder_record(run_dir) is not None  # the file stays; the kernel dropped the lock
    newest = checkpoint_steps(run_dir)[-1]
    assert 2 * CKPT_EVERY <= newest < STEPS
    second = start_demo(run_dir, steps=STEPS, ckpt_every=CKPT_EVERY)
    try:
        took = _wait_for_holder(run_dir, second.pid)
        out, _ = second.communicate(timeout=120)
    finally:
        _stop(second)
    assert took < 1.0, f"the lock was taken {took:.2f}s after the start"
    assert second.returncode == 0, out
    assert f"step_{newest:06d} (step {newest}," in out  # "resumed from .../step_0000NN (step NN"
    assert manifest(run_dir, STEPS)["fingerprint"] == manifest(alone, STEPS)["fingerprint"]
    assert LossLog(run_dir).read() == LossLog(alone).read()


@pytest.mark.slow
def test_demo_on_a_supervised_run_dir_exits_2_naming_the_supervisor(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "runner", "run", "--run-dir", str(run_dir), "--grace-seconds",
         "5", "--", sys.executable, "-c", "import time; time.sleep(60)"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for_holder(run_dir, supervisor.pid)
        demo, took = _timed(demo_cmd(run_dir, steps=STEPS))
        assert demo.returncode == EXIT_USAGE, demo.stderr
        assert took < 1.0, f"the demo took {took:.2f}s to give up"
        assert f"in use by pid {supervisor.pid} on host {HOST} (runner run, started" in (
            demo.stderr
        )
        assert not (run_dir / "loss.jsonl").exists()
        assert checkpoint_steps(run_dir) == []
        supervisor.send_signal(signal.SIGTERM)
        out, _ = supervisor.communicate(timeout=30)
    finally:
        _stop(supervisor)
    # the trainer was killed by the forwarded SIGTERM with nothing committed: not 75
    assert supervisor.returncode == 1, out
    assert "no checkpoint stands" in out or "none stands" in out, out
    # and now the run dir is free
    done = run_demo(run_dir, steps=3, ckpt_every=3)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_runner_run_of_runner_demo_works_under_the_supervisors_lock(
    tmp_path: Path, alone: Path
) -> None:
    run_dir = tmp_path / "run"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "runner", "run", "--run-dir", str(run_dir), "--steps",
         str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--", sys.executable, "-m", "runner",
         "demo", "--device", "cpu", "--threads", "1", "--no-progress"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for_holder(run_dir, supervisor.pid)
        wait_for_step(supervisor, run_dir, 5)
        # the trainer works under its supervisor's lock; anyone else is still refused
        intruder, _ = _timed(demo_cmd(run_dir, steps=STEPS))
        assert intruder.returncode == EXIT_USAGE, intruder.stderr
        assert f"in use by pid {supervisor.pid} on host {HOST} (runner run" in intruder.stderr
        out, _ = supervisor.communicate(timeout=120)
    finally:
        _stop(supervisor)
    assert supervisor.returncode == 0, out
    assert "trainer finished (exit 0)" in out
    assert manifest(run_dir, STEPS)["fingerprint"] == manifest(alone, STEPS)["fingerprint"]
    assert LossLog(run_dir).read() == LossLog(alone).read()


def test_train_session_refuses_a_locked_run_dir_before_writing_anything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        token = holder.stdout.readline().strip()
        assert len(token) == 32
        with pytest.raises(RunDirLockedError) as refused:
            TrainSession(RunConfig(run_dir=run_dir), state=object())  # type: ignore[arg-type]
        assert exit_code_for(refused.value) == EXIT_USAGE
        assert f"in use by pid {holder.pid} on host {HOST} (test holder, started" in str(
            refused.value
        )
        assert sorted(p.name for p in run_dir.iterdir()) == [runlock.LOCK_FILE]
        # a supervisor's token lets its child work under the lock; a wrong one does not
        with pytest.raises(RunDirLockedError):
            runlock.acquire(run_dir, command="child", supervisor_token="0" * 32)
        with runlock.acquire(run_dir, command="child", supervisor_token=token) as lock:
            assert lock.how == "inherited"
            assert lock.child_env() == {runlock.ENV_LOCK_TOKEN: token}
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its token no longer means anything, the lock is simply free
    with runlock.acquire(run_dir, command="next", supervisor_token=token) as lock:
        assert lock.how == "locked"
        assert lock.token != token
        record = _holder_record(run_dir)
        assert record is not None
        assert (record["pid"], record["host"], record["command"]) == (os.getpid(), HOST, "next")


def test_a_session_that_fails_to_start_releases_the_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(self: TrainSession) -> None:
        raise RunDirLockedError("stand-in for a refusal while restoring")

    monkeypatch.setattr(TrainSession, "restore", refuse)
    config = RunConfig(run_dir=tmp_path)
    with (
        pytest.raises(RunDirLockedError, match="stand-in"),
        TrainSession(config, state=object()),  # type: ignore[arg-type]
    ):
        pass
    free, _ = _timed([sys.executable, "-c", HOLDER, str(tmp_path)], input="")
    assert free.returncode == 0, free.stderr


def test_one_process_shares_its_own_hold_and_releases_it_with_the_last(tmp_path: Path) -> None:
    outer = runlock.acquire(tmp_path, command="cli")
    inner = runlock.acquire(tmp_path / ".", command="TrainSession")  # same file, other path
    assert inner.token == outer.token
    inner.release()
    probe = [sys.executable, "-c", HOLDER, str(tmp_path)]
    held, _ = _timed(probe, input="")
    assert held.returncode == 1 and "RunDirLockedError" in held.stderr  # still held by outer
    outer.release()
    free, _ = _timed(probe, input="")
    assert free.returncode == 0, free.stderr


@pytest.mark.slow
def test_the_lock_file_is_no_checkpoint_for_any_command(tmp_path: Path, alone: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(alone, run_dir)
    assert (run_dir / runlock.LOCK_FILE).is_file()
    bucket = tmp_path / "bucket"
    for args in (
        ["push", str(run_dir), f"file://{bucket}"],
        ["prune", str(run_dir), "--keep", "2"],
        ["fork", str(run_dir), str(tmp_path / "fork")],
        ["pivot", str(run_dir)],
    ):
        done, _ = _timed([sys.executable, "-m", "runner", *args])
        assert done.returncode == 0, (args, done.stderr)
    listed, _ = _timed([sys.executable, "-m", "runner", "ls", str(run_dir), "--json"])
    assert listed.returncode == 0, listed.stderr
    assert runlock.LOCK_FILE not in listed.stdout
    uploaded = [p.relative_to(bucket).as_posix() for p in bucket.rglob("*") if p.is_file()]
    assert uploaded and all(p.startswith("checkpoints/step_") for p in uploaded), uploaded
    assert not (tmp_path / "fork" / runlock.LOCK_FILE).exists()
    assert (run_dir / runlock.LOCK_FILE).is_file()  # and nothing removed it


@pytest.mark.slow
def test_an_orphaned_trainer_keeps_the_run_dir_locked_after_its_supervisor_is_sigkilled(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    pid_file = tmp_path / "trainer.pid"
    trainer = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "runner", "run", "--run-dir", str(run_dir), "--",
         sys.executable, "-c", trainer, str(pid_file)],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    orphan_pid = 0
    try:
        end = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < end:
            time.sleep(0.05)
        orphan_pid = int(pid_file.read_text())
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(timeout=10)
        # the trainer lives on in its own session, and so does the lock it inherited
        second = run_demo(run_dir, steps=5, env=_env(), timeout=60)
        assert second.returncode == EXIT_USAGE, second.stderr
        assert f"pid {supervisor.pid}" in second.stderr
        assert checkpoint_steps(run_dir) == []
    finally:
        if orphan_pid:
            os.kill(orphan_pid, signal.SIGKILL)
        if supervisor.poll() is None:
            supervisor.kill()
    # once the orphan is gone, a new start takes the lock at once
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            os.kill(orphan_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    third = run_demo(run_dir, steps=5, env=_env(), timeout=120)
    assert third.returncode == 0, third.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["pivot", "{run}"],
        ["prune", "{run}", "--keep", "2"],
        ["pull", "{bucket}", "{run}"],
        ["repair", "{run}"],
    ],
)
def test_commands_that_change_a_run_dir_exit_2_while_a_trainer_holds_it(
    tmp_path: Path, alone: Path, command: list[str]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(alone, run_dir)
    (run_dir / "samples.json").write_text("{}")
    bucket = f"file://{tmp_path / 'bucket'}"
    push = subprocess.run(
        [sys.executable, "-m", "runner", "push", str(alone), bucket],
        env=_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert push.returncode == 0, push.stderr
    before = {
        p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".runner.lock"
    }
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        holder.stdout.readline()
        args = [a.format(run=run_dir, bucket=bucket) for a in command]
        done = subprocess.run(
            [sys.executable, "-m", "runner", *args], env=_env(), capture_output=True, text=True
        )
        assert done.returncode == EXIT_USAGE, done.stdout + done.stderr
        assert f"pid {holder.pid}" in done.stderr and "Traceback" not in done.stderr
    finally:
        holder.communicate(input="", timeout=10)
    after = {
        p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".runner.lock"
    }
    assert after == before
