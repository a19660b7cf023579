"""A `with TrainSession` block left by SystemExit after a stop: a framework's own SIGTERM
handler (PyTorch Lightning raises `SIGTERMException`, a SystemExit with no code, at a batch
boundary) must never end the process with exit 0, and no checkpoint is written past the last
step boundary the session saw. Real processes, a real SIGTERM, a real SystemExit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.demo_process import checkpoint_steps

PROGRAM = textwrap.dedent(
    """
    import os, signal, sys
    from runner.preemption import install_signal_handlers
    from runner.preemption.stop import StopController
    from runner.session import TrainSession
    from tests.fixtures.train_loop import config, new_state, train_step
    from pathlib import Path

    class SIGTERMException(SystemExit):  # what PyTorch Lightning raises on SIGTERM
        pass

    tmp, mode, code = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    stop = StopController()
    install_signal_handlers(stop, grace_seconds=30)
    state = new_state()
    with TrainSession(config(tmp, ckpt_every=2, save_mode=mode), state=state, stop=stop) as s:
        while not s.should_stop:
            train_step(state)
            s.step_done()
            if state.counters.step == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # handled: a stop is requested
                train_step(state)  # the framework steps on before its own handler raises
                raise SIGTERMException() if code == "none" else SystemExit(int(code))
    sys.exit(99)  # never reached
    """
)


def _run(tmp_path: Path, mode: str, code: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(PROGRAM)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), mode, code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("code", ["none", "0"])
def test_system_exit_after_a_stop_exits_1_naming_the_checkpoint_that_stands(
    tmp_path: Path, mode: str, code: str
) -> None:
    done = _run(tmp_path, mode, code)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "the training loop was left by SystemExit after a stop (SIGTERM) at step 6" in (
        done.stderr
    ), done.stderr
    assert "checkpoint step 4 (" in done.stderr and ") stands. Exiting 1, not 0" in done.stderr
    # nothing past the last step boundary the session saw: steps 2 and 4, no 5 or 6
    assert checkpoint_steps(tmp_path / "run") == [2, 4]


@pytest.mark.slow
def test_a_nonzero_system_exit_after_a_stop_keeps_its_code(tmp_path: Path) -> None:
    done = _run(tmp_path, "sync", "3")
    assert done.returncode == 3, done.stderr
    assert "left by SystemExit" not in done.stderr
