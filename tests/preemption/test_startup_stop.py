"""A stop request interrupts start-up: `runner demo` whose
mirror accepts connections and never answers exits 75 on SIGTERM within the grace period,
and a download given up on is never published into the run dir."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from runner.errors import EXIT_PREEMPTED
from runner.mirror.resume import choose_resume
from runner.preemption.startup import StartupInterrupted, run_interruptible
from runner.preemption.stop import StopController
from runner.storage.base import ProgressCallback
from runner.storage.file import FileStorage
from tests.fixtures.aws_env import isolated_aws_env
from tests.fixtures.blackhole import FakeBlackholeServer
from tests.fixtures.ckpt import SaveCheckpoint
from tests.fixtures.demo_process import checkpoint_steps, demo_cmd, logged_steps

REPO = Path(__file__).resolve().parents[2]
GRACE_S = 5


def _fake_store_env(endpoint: str) -> dict[str, str]:
    return isolated_aws_env(AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1")


def _sigterm_during_startup(run_dir: Path, cmd: list[str] | None = None) -> tuple[int, str, float]:
    """Start the demo (or `cmd`) against the fake store, SIGTERM once it is talking to it;
    returns (exit code, stderr, seconds from SIGTERM to exit)."""
    with FakeBlackholeServer() as hole:
        if cmd is None:
            cmd = demo_cmd(run_dir, "--mirror", "s3://bucket/p", "--grace-seconds", str(GRACE_S))
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=_fake_store_env(hole.endpoint),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 120
            while hole.accepted == 0 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert hole.accepted > 0 and proc.poll() is None, "never reached the store"
            time.sleep(0.5)  # well inside the first request's read timeout
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            _, err = proc.communicate(timeout=GRACE_S + 60)
            took = time.monotonic() - sent
        finally:
            proc.kill()
            proc.wait()
    return proc.returncode, err, took


@pytest.mark.slow
def test_fake_silent_store_sigterm_during_startup_exits_75_within_grace(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, err, took = _sigterm_during_startup(run_dir)
    assert code == EXIT_PREEMPTED, err
    assert took <= GRACE_S + 2, (took, err)
    assert "Traceback" not in err
    assert "stop requested (SIGTERM) during resume resolution: given up" in err
    ckpt_dir = run_dir / "checkpoints"
    assert not ckpt_dir.exists() or sorted(p.name for p in ckpt_dir.iterdir()) == []
    assert logged_steps(run_dir) == []


def test_fake_silent_store_sigterm_during_runner_run_startup_exits_75_without_a_trainer(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    started = tmp_path / "trainer-started"
    cmd = [
        sys.executable, "-m", "runner", "run", "--run-dir", str(run_dir),
        "--mirror", "s3://bucket/p", "--grace-seconds", str(GRACE_S), "--",
        sys.executable, "-c", f"open({str(started)!r}, 'w').close()",
    ]  # fmt: skip
    code, err, took = _sigterm_during_startup(run_dir, cmd)
    assert code == EXIT_PREEMPTED, err
    assert took <= GRACE_S + 2, (took, err)
    assert "Traceback" not in err
    assert "stop requested (SIGTERM) during resume resolution: given up" in err
    assert "the trainer was not started" in err
    assert not started.exists()
    assert checkpoint_steps(run_dir) == []


@pytest.mark.slow
def test_fake_silent_store_sigterm_during_a_resumed_startup_keeps_the_checkpoint(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.run(
        demo_cmd(run_dir, steps=4, ckpt_every=2), cwd=REPO, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    code, err, took = _sigterm_during_startup(run_dir)
    assert code == EXIT_PREEMPTED, err
    assert took <= GRACE_S + 2, (took, err)
    assert "Traceback" not in err
    after = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    assert after == before and checkpoint_steps(run_dir) == [2, 4]
    assert max(logged_steps(run_dir)) == 4


class FakeStalledStore(FileStorage):
    """A real file:// store whose downloads stall until the test releases them (a fake:
    a real store stalls on its own schedule, not on the test's)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.entered = threading.Event()
        self.release = threading.Event()

    def get_file(
        self,
        key: str,
        dst: Path,
        *,
        progress: ProgressCallback | None = None,
        sha256: str | None = None,
        size: int | None = None,
    ) -> None:
        self.entered.set()
        assert self.release.wait(60)
        super().get_file(key, dst, progress=progress, sha256=sha256, size=size)


@pytest.mark.parametrize("stop_first", [True, False])
def test_fake_stalled_download_given_up_on_is_never_published(
    tmp_path: Path, save_checkpoint: SaveCheckpoint, stop_first: bool
) -> None:
    """stop_first=False is the control: the same download, not given up on, is published."""
    save_checkpoint(5, run_dir=tmp_path / "bucket")
    store = FakeStalledStore(tmp_path / "bucket")
    run_dir = tmp_path / "run"
    stop = StopController()

    def resolve() -> object:
        return choose_resume(run_dir, store)

    if stop_first:
        threading.Thread(
            target=lambda: store.entered.wait(60) and stop.request_stop("SIGTERM")
        ).start()
        with pytest.raises(StartupInterrupted, match="during resume resolution: given up"):
            run_interruptible(resolve, stop=stop, what="resume resolution")
    else:
        store.release.set()
        choice = run_interruptible(resolve, stop=stop, what="resume resolution")
        assert choice is not None and getattr(choice, "step_dir", None) is not None
    store.release.set()
    for t in threading.enumerate():
        if t.name == "startup: resume resolution":
            t.join(30)
    published = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert published == ([] if stop_first else ["step_000005"])
    stop.close()


def test_a_stop_before_startup_work_starts_skips_it() -> None:
    stop = StopController()
    stop.request_stop("SIGTERM")
    called: list[int] = []
    with pytest.raises(StartupInterrupted, match=r"stop requested \(SIGTERM\) before x"):
        run_interruptible(lambda: called.append(1), stop=stop, what="x")
    assert called == []
    stop.close()


def test_startup_work_errors_reach_the_caller() -> None:
    def fail() -> None:
        raise ValueError("boom")

    stop = StopController()
    with pytest.raises(ValueError, match="boom"):
        run_interruptible(fail, stop=stop, what="x")
    assert run_interruptible(lambda: 7, stop=stop, what="x") == 7
    stop.close()


@pytest.mark.slow
def test_a_refused_checkpoint_is_logged_once_under_runner_run(tmp_path: Path) -> None:
    """`runner run -- runner demo`: the supervisor resolves the run dir, then the demo does
    again; the refusal of the corrupt newest checkpoint is logged once, not by both."""
    run_dir = tmp_path / "run"
    first = subprocess.run(
        demo_cmd(run_dir, steps=4, ckpt_every=2), cwd=REPO, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    payload = run_dir / "checkpoints/step_000004/state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))
    trainer = demo_cmd(run_dir, steps=6, ckpt_every=2)
    trainer.remove("--run-dir")
    trainer.remove(str(run_dir))  # the supervisor passes RUNNER_RUN_DIR
    done = subprocess.run(
        [trainer[0], "-m", "runner", "run", "--run-dir", str(run_dir), "--", *trainer],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert output.count("not resuming from step 4:") == 1, output
    assert "sha256 mismatch" in output and checkpoint_steps(run_dir) == [2, 4, 6]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_fake_silent_store_a_command_without_a_stop_controller_still_ends_on_a_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Signals recorded from the first instant belong to demo/run only: `runner ls` waiting
    on a silent store ends on SIGTERM (default action) or Ctrl-C (Aborted, 1) as before."""
    with FakeBlackholeServer() as hole:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runner", "ls", "s3://bucket/p"],
            cwd=REPO,
            env=_fake_store_env(hole.endpoint),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while hole.accepted == 0 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert hole.accepted > 0 and proc.poll() is None, "never reached the store"
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=10)
        finally:
            proc.kill()
            proc.wait()
    if sig == signal.SIGTERM:
        assert proc.returncode == -signal.SIGTERM, err
    else:
        assert proc.returncode == 1 and "Aborted." in err, err


TRAIN_FIRST_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from runner.config import RunConfig
    from runner.preemption.signals import install_signal_handlers
    from runner.preemption.stop import StopController
    from runner.session.train_session import TrainSession
    from runner.state.train_state import ModuleTrainState

    config = RunConfig(run_dir=sys.argv[1], mirror="s3://bucket/p", steps=1000,
                       ckpt_every=1, grace_seconds=float(sys.argv[2]))
    stop = StopController()
    restore = install_signal_handlers(stop, grace_seconds=config.grace_seconds)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ModuleTrainState(model=model, optimizer=opt)
    x = torch.ones(8, 4)
    with TrainSession(config, state=state, stop=stop) as session:
        for _ in range(1000):  # trains first, asks afterwards: a common loop shape
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.advance(loss=loss.item())
            if session.step_done():
                break
    restore()
    sys.exit(session.exit_code)
    """
)


@pytest.mark.slow
def test_fake_silent_store_a_loop_that_trains_before_asking_saves_and_logs_nothing(
    tmp_path: Path,
) -> None:
    """Start-up given up on: the step such a loop takes from state that was never restored is
    neither logged (it would overwrite the audit line of the run's real step 1) nor saved."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    history = b'{"step": 1, "loss": 123.0}\n'
    (run_dir / "loss.jsonl").write_bytes(history)
    script = tmp_path / "train.py"
    script.write_text(TRAIN_FIRST_SCRIPT)
    cmd = [sys.executable, str(script), str(run_dir), str(GRACE_S)]
    code, err, took = _sigterm_during_startup(run_dir, cmd)
    assert code == EXIT_PREEMPTED, err
    assert took <= GRACE_S + 2, (took, err)
    assert "during resume resolution: given up" in err
    assert (run_dir / "loss.jsonl").read_bytes() == history
    assert checkpoint_steps(run_dir) == []
