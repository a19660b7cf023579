"""Signals from the first instant to the last, with real processes and real signals:
a SIGTERM in the first second, a second SIGTERM while the process is on its way out,
and repeated SIGTERMs at a user's script after its TrainSession stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from tests.fixtures.demo_process import (
    checkpoint_steps,
    demo_cmd,
    logged_steps,
    manifest,
    wait_for_step,
)

REPO = Path(__file__).resolve().parents[2]
EXIT_PREEMPTED = 75

# The console script's wrapper (pip generates the same two lines from [project.scripts]).
CONSOLE_SCRIPT = [
    sys.executable,
    "-c",
    "import sys; from runner.entry import main; sys.exit(main())",
]


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _entry(how: str, run_dir: Path, **kw: int) -> list[str]:
    cmd = demo_cmd(run_dir, **kw)  # [python, -m, runner, demo, ...]
    return cmd if how == "python -m runner" else CONSOLE_SCRIPT + cmd[3:]


def test_the_console_script_is_the_early_entry() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"runner": "runner.entry:main"}
    assert (REPO / "runner/__main__.py").read_text() == "from runner.entry import main\n\nmain()\n"


@pytest.mark.slow
@pytest.mark.parametrize("gap_s", [0.0, 0.05, 0.2, 0.5])
def test_a_second_sigterm_after_the_first_never_changes_exit_75(
    tmp_path: Path, gap_s: float
) -> None:
    run_dir = tmp_path / "run"
    proc = _start(demo_cmd(run_dir, steps=5000, ckpt_every=1000))
    try:
        wait_for_step(proc, run_dir, 3)
        proc.send_signal(signal.SIGTERM)
        time.sleep(gap_s)
        # the process may be gone already (then nothing could change its code any more)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "Traceback" not in err
    stopped_at = max(logged_steps(run_dir))
    assert checkpoint_steps(run_dir) == [stopped_at]
    assert manifest(run_dir, stopped_at)["step"] == stopped_at
    assert f"stopped by SIGTERM at step {stopped_at}: final checkpoint durable" in err


@pytest.mark.slow
def test_a_sigint_then_sigterms_keep_the_first_signal_as_the_reason(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(demo_cmd(run_dir, steps=5000, ckpt_every=1000))
    try:
        wait_for_step(proc, run_dir, 3)
        proc.send_signal(signal.SIGINT)
        for _ in range(5):
            time.sleep(0.05)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "stopped by SIGINT at step" in err and "stopped by SIGTERM" not in err


@pytest.mark.slow
@pytest.mark.parametrize("how", ["python -m runner", "console script"])
@pytest.mark.parametrize("after_s", [0.1, 0.5, 1.0])
def test_sigterm_right_after_start_exits_75_with_nothing_trained(
    tmp_path: Path, how: str, after_s: float
) -> None:
    """Before a checkpoint exists: 75 (nothing was trained, so nothing was lost; the
    documented rule), not -15, and no checkpoint of step 0 is written."""
    run_dir = tmp_path / "run"
    proc = _start(_entry(how, run_dir, steps=5000, ckpt_every=1000))
    try:
        time.sleep(after_s)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "Traceback" not in err
    _assert_clean_stop(run_dir, err, resumed_at=0)


def _assert_clean_stop(run_dir: Path, err: str, *, resumed_at: int) -> None:
    """Stopped before training (the case on this machine: torch alone imports for longer
    than 1 s) or, on a faster one, after a few steps with their final checkpoint."""
    trained = [s for s in logged_steps(run_dir) if s > resumed_at]
    if not trained:
        # before the resume (step 0, nothing restored) or right after it (its checkpoint stands)
        assert "stopped by SIGTERM at step 0 before anything was trained" in err or (
            resumed_at > 0 and f"stopped by SIGTERM at step {resumed_at}:" in err
        ), err
        assert checkpoint_steps(run_dir) == ([] if resumed_at == 0 else [2, 4])
    else:
        assert f"stopped by SIGTERM at step {max(trained)}: final checkpoint durable" in err
        assert max(trained) in checkpoint_steps(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.1, 0.5, 1.0])
def test_sigterm_right_after_start_of_a_resumed_run_exits_75_and_keeps_its_checkpoint(
    tmp_path: Path, after_s: float
) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.run(
        demo_cmd(run_dir, steps=4, ckpt_every=2), cwd=REPO, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    before = {s: (run_dir / f"checkpoints/step_{s:06d}/manifest.json").read_bytes() for s in (2, 4)}
    proc = _start(_entry("python -m runner", run_dir, steps=5000, ckpt_every=1000))
    try:
        time.sleep(after_s)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "Traceback" not in err
    after = {s: (run_dir / f"checkpoints/step_{s:06d}/manifest.json").read_bytes() for s in (2, 4)}
    assert after == before
    _assert_clean_stop(run_dir, err, resumed_at=4)


USER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from runner.config import RunConfig
    from runner.preemption.signals import install_signal_handlers
    from runner.preemption.stop import StopController
    from runner.session.train_session import TrainSession
    from runner.state.train_state import ModuleTrainState

    config = RunConfig(run_dir=sys.argv[1], steps=100_000, ckpt_every=1000)
    stop = StopController()
    restore = install_signal_handlers(stop, grace_seconds=config.grace_seconds)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ModuleTrainState(model=model, optimizer=opt)
    x = torch.ones(8, 4)
    with TrainSession(config, state=state, stop=stop) as session:
        while not session.should_stop:
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.advance(loss=loss.item())
            session.step_done()
            time.sleep(0.005)
    restore()
    print(f"session done {session.exit_code} step {session.step}", flush=True)
    time.sleep(1.0)  # the script's own epilogue, while the orchestrator repeats SIGTERM
    sys.exit(session.exit_code)
    """
)


@pytest.mark.slow
def test_repeated_sigterm_after_a_train_session_stopped_leaves_the_scripts_exit_code(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(proc, run_dir, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        for _ in range(6):  # during the epilogue and the interpreter's teardown
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert line.startswith(f"session done {EXIT_PREEMPTED} step "), (line, err)
    assert proc.returncode == EXIT_PREEMPTED, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    step = int(line.split()[-1])
    assert checkpoint_steps(run_dir) == [step]


def test_restore_puts_the_previous_handlers_back_when_no_stop_happened() -> None:
    from runner.preemption.signals import install_signal_handlers
    from runner.preemption.stop import StopController

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    c = StopController()
    restore = install_signal_handlers(c, grace_seconds=5.0)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert c.wait_any(2.0) and not c.stop_requested
    restore()
    c.close()
    assert {s: signal.getsignal(s) for s in before} == before


def test_early_signals_are_replayed_in_arrival_order_with_deadlines_from_arrival() -> None:
    from runner.preemption import early
    from runner.preemption.signals import install_signal_handlers
    from runner.preemption.stop import StopController

    before = {s: signal.getsignal(s) for s in early.HANDLED}
    try:
        early.install_early_handlers()
        t0 = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        c = StopController()
        restore = install_signal_handlers(c, grace_seconds=10.0)
        assert c.reason == "SIGINT" and c.stop_count == 2
        assert c.take_checkpoint_request() == "SIGUSR1"
        deadline = c.deadline
        assert deadline is not None and t0 + 10.0 <= deadline < t0 + 10.2
        assert early.EARLY == []
        restore(force=True)
        c.close()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
