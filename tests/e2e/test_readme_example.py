"""The README's in-process example runs as written, stops on SIGTERM with 75 and resumes, and
(through `runner.log_to_stderr()`) says so on stderr."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.demo_process import checkpoint_steps, logged_steps

README = Path(__file__).resolve().parents[2] / "README.md"

# What the README leaves to the reader: a model with .loss, an optimizer, a schedule, data.
PREAMBLE = """
import torch
torch.manual_seed(0)
torch.set_num_threads(1)

class Data:
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(256, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True)
    def __len__(self):
        return len(self.x)
    def batch(self, idx):
        return self.x[idx], self.y[idx]

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(16, 1))
    def loss(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)

dataset = Data()
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5)
"""


def readme_program(run_dir: Path, bucket: Path, *, steps: int) -> str:
    block = re.search(r"## Your own PyTorch loop\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None, "README lost its in-process example"
    code = block.group(1)
    # the early recorder comes first, before torch: the reader's objects go where torch is
    early = code.index("install_early_handlers()\n")
    torch_line = re.search(r"^import torch\b.*\n", code, re.M)
    assert torch_line is not None and torch_line.start() > early, code
    code = code[: torch_line.start()] + PREAMBLE + code[torch_line.end() :]
    code = code.replace('"runs/exp1"', repr(str(run_dir)))
    code = code.replace('"s3://my-bucket/exp1"', repr(f"file://{bucket}"))
    code = code.replace("steps=10_000", f"steps={steps}").replace("ckpt_every=500", "ckpt_every=25")
    return code


def test_readme_example_runs_stops_and_resumes(tmp_path: Path) -> None:
    program = tmp_path / "train.py"
    program.write_text(readme_program(tmp_path / "run", tmp_path / "bucket", steps=100_000))
    proc = subprocess.Popen([sys.executable, str(program)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while max(logged_steps(tmp_path / "run"), default=0) < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    stopped = checkpoint_steps(tmp_path / "run")[-1]
    assert stopped >= 30
    assert stopped in checkpoint_steps(tmp_path / "bucket"), "final checkpoint not mirrored"
    # log_to_stderr() in the example: the session's own lines, formatted, on stderr
    log_line = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO runner\.session\.train_session: "
    assert re.search(log_line + r"no checkpoint to resume from in ", err, re.M), err
    committed = re.findall(log_line + r"checkpoint step (\d+) committed in ", err, re.M)
    assert committed[0] == "25" and committed[-1] == str(stopped), err  # a cadence and the final

    program.write_text(readme_program(tmp_path / "run", tmp_path / "bucket", steps=stopped + 10))
    done = subprocess.run([sys.executable, str(program)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    resumed = (
        r"INFO runner\.session\.train_session: "
        rf"resumed from \S*step_{stopped:06d} \(step {stopped}, "
    )
    assert re.search(resumed, done.stderr), done.stderr
    assert re.search(rf"checkpoint step {stopped + 10} committed in ", done.stderr), done.stderr
    assert checkpoint_steps(tmp_path / "run")[-1] == stopped + 10
    # resumed, not restarted: every step was trained exactly once across the two processes
    assert logged_steps(tmp_path / "run") == list(range(1, stopped + 11))


def _catches_sigterm(pid: int) -> bool:
    """Whether `pid` has a handler for SIGTERM now (the SigCgt mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_readme_example_stopped_while_torch_is_still_importing_exits_75(tmp_path: Path) -> None:
    """A real SIGTERM after the example's first line ran but before `import torch` finished:
    recorded, replayed, and the run ends 75 with nothing trained, instead of dying with 143."""
    program = tmp_path / "train.py"
    program.write_text(readme_program(tmp_path / "run", tmp_path / "bucket", steps=100))
    proc = subprocess.Popen([sys.executable, str(program)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _catches_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "no early recorder"
            time.sleep(0.001)
        # torch's shared library is not mapped yet: the signal lands during the import
        torch_loaded = "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not torch_loaded, "the signal came too late to test the early recorder"
    assert proc.returncode == 75, err
    assert "stopped by SIGTERM at step 0 before anything was trained" in err, err
    assert checkpoint_steps(tmp_path / "run") == []
