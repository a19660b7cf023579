"""Start `runner demo` as a real subprocess and watch its run dir (shared by e2e tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEMO_STEPS = 60


def demo_cmd(
    run_dir: Path, *extra: str, steps: int = DEMO_STEPS, ckpt_every: int = 20
) -> list[str]:
    return [
        sys.executable, "-m", "runner", "demo", "--run-dir", str(run_dir),
        "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--device", "cpu",
        "--threads", "1", "--no-progress", *extra,
    ]  # fmt: skip


def start_demo(
    run_dir: Path, *extra: str, env: dict[str, str] | None = None, **kw: int
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        demo_cmd(run_dir, *extra, **kw),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def run_demo(
    run_dir: Path, *extra: str, env: dict[str, str] | None = None, timeout: float = 300, **kw: int
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        demo_cmd(run_dir, *extra, **kw),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def logged_steps(run_dir: Path) -> list[int]:
    try:
        lines = (run_dir / "loss.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "step" in record:
            steps.append(int(record["step"]))
    return steps


def wait_for_step(
    proc: subprocess.Popen[str], run_dir: Path, step: int, timeout: float = 120
) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = logged_steps(run_dir)
        if steps and max(steps) >= step:
            return max(steps)
        if proc.poll() is not None:
            output = proc.stdout.read() if proc.stdout else ""
            if proc.stderr is not None:  # kept apart by the caller: show it too
                output += proc.stderr.read()
            raise AssertionError(f"demo exited {proc.returncode} before step {step}: {output}")
        time.sleep(0.01)
    raise AssertionError(f"demo did not reach step {step} in {timeout}s")


def checkpoint_steps(run_dir: Path) -> list[int]:
    ckpt = run_dir / "checkpoints"
    if not ckpt.exists():
        return []
    return sorted(
        int(p.name.split("_")[1])
        for p in ckpt.iterdir()
        if p.name.startswith("step_") and (p / "manifest.json").exists()
    )


def manifest(run_dir: Path, step: int) -> dict[str, object]:
    data: dict[str, object] = json.loads(
        (run_dir / "checkpoints" / f"step_{step:06d}" / "manifest.json").read_text()
    )
    return data
