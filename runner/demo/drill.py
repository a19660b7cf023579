"""`runner drill`: the resume audit. Trains the demo straight, then again with SIGTERM at a
random step and a resume in a fresh process, compares the two, and tabulates what each
omission a careless checkpoint makes would have cost."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from runner.audit.outcome import RunOutcome, differing_steps, outcome
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.loss_log import LossLog
from runner.errors import EXIT_OK, EXIT_PREEMPTED, RunnerError
from runner.storage.file import FileStorage

SIGTERM_TIMEOUT_SECONDS = 120.0
__all__ = ["DrillReport", "RunOutcome", "outcome", "run_drill"]


@dataclass(frozen=True, kw_only=True)
class DrillReport:
    steps: int
    stopped_at: int
    straight: RunOutcome
    resumed: RunOutcome

    def loss_verdict(self) -> str:
        straight, resumed = self.straight.losses, self.resumed.losses
        differing = differing_steps(straight, resumed)
        if not differing:
            return f"identical at all {len(straight)} steps"
        return f"differs at {len(differing)} steps, first at step {differing[0]}"

    @property
    def exact(self) -> bool:
        return (
            self.straight.fingerprint == self.resumed.fingerprint
            and self.straight.losses == self.resumed.losses
        )


def demo_command(run_dir: Path, *, steps: int, seed: int, ckpt_every: int) -> list[str]:
    return [
        sys.executable, "-m", "runner", "demo",
        "--run-dir", str(run_dir), "--steps", str(steps), "--seed", str(seed),
        "--ckpt-every", str(ckpt_every), "--device", "cpu", "--no-progress",
    ]  # fmt: skip


def run_to_end(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != EXIT_OK:
        raise RunnerError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")


def run_and_interrupt(cmd: list[str], *, run_dir: Path, at_step: int) -> int:
    """Start the job, SIGTERM it once its loss log reaches `at_step`; returns the step it
    stopped at (its final checkpoint)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + SIGTERM_TIMEOUT_SECONDS
    log = LossLog(run_dir)
    while proc.poll() is None and time.monotonic() < deadline:
        if max(log.read(), default=0) >= at_step:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=SIGTERM_TIMEOUT_SECONDS)
    if proc.returncode != EXIT_PREEMPTED:
        raise RunnerError(f"interrupted run exited {proc.returncode}, expected 75:\n{err[-2000:]}")
    return list_checkpoints(FileStorage(run_dir))[-1]


def random_stop_step(steps: int) -> int:
    # leave room after the signal: the job stops at the end of the step it is in
    return random.Random(os.urandom(8)).randint(1, max(1, steps - 1 - steps // 4))


def run_drill(*, work_dir: Path, steps: int, seed: int, stop_at: int | None) -> DrillReport:
    if stop_at is None:
        stop_at = random_stop_step(steps)
    ckpt_every = max(1, steps // 3)
    straight_dir, resumed_dir = work_dir / "straight", work_dir / "resumed"
    run_to_end(demo_command(straight_dir, steps=steps, seed=seed, ckpt_every=ckpt_every))
    cmd = demo_command(resumed_dir, steps=steps, seed=seed, ckpt_every=ckpt_every)
    stopped_at = run_and_interrupt(cmd, run_dir=resumed_dir, at_step=stop_at)
    run_to_end(cmd)  # a fresh process resumes from the final checkpoint
    return DrillReport(
        steps=steps,
        stopped_at=stopped_at,
        straight=outcome(straight_dir),
        resumed=outcome(resumed_dir),
    )


def report_json(report: DrillReport, ablations: list[dict[str, object]]) -> str:
    return json.dumps(
        {
            "steps": report.steps,
            "stopped_at": report.stopped_at,
            "exact": report.exact,
            "straight_fingerprint": report.straight.fingerprint,
            "resumed_fingerprint": report.resumed.fingerprint,
            "ablations": ablations,
        },
        indent=2,
    )
