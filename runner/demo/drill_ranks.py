"""`runner drill --ranks N`: the resume audit of a multi-rank job under torchrun.

A straight N-rank run; the same job with SIGTERM to one rank (the last) and a resume at N
ranks, which must match the straight run exactly; and the stopped checkpoint resumed at M
ranks in a copy of its run dir, which must end at the straight run's samples_seen having
consumed every sample exactly once (audited from the demo's per-rank sample logs:
drill_ranks_report). The fingerprints of different world sizes are not compared: the
gradients' float sums are reduced in another order, so the weights differ in their last bits.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.loss_log import LossLog
from runner.demo.drill import SIGTERM_TIMEOUT_SECONDS, DrillReport, outcome
from runner.demo.drill_ranks_report import RankedDrillReport, Rescaled, audit_samples, read_samples
from runner.errors import EXIT_OK, EXIT_PREEMPTED, RunnerError
from runner.storage.file import FileStorage

BATCH_SIZE = 4  # per rank: small, so a launch's time is mostly torch's start
RUN_TIMEOUT_SECONDS = 600.0
_EXIT = re.compile(r"rank (\d+) of (\d+): exit (-?\d+)")


def _demo_args(run_dir: Path, sample_log: Path, *, steps: int, seed: int, every: int) -> list[str]:
    return [
        "-m", "runner", "demo", "--run-dir", str(run_dir), "--steps", str(steps),
        "--seed", str(seed), "--ckpt-every", str(every), "--batch-size", str(BATCH_SIZE),
        "--device", "cpu", "--threads", "1", "--no-progress", "--sample-log", str(sample_log),
    ]  # fmt: skip


@dataclass
class _Job:
    """One launch of the demo: `world_size` ranks under torchrun, or one plain process."""

    name: str
    world_size: int
    run_dir: Path
    samples: Path
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=RUN_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RunnerError(
                f"{self.name} run still running after {RUN_TIMEOUT_SECONDS:g} s"
            ) from None

    def rank_pid(self, rank: int) -> int:
        """The PID of rank `rank`: the process itself alone, else the agent's child whose
        environment says RANK=rank."""
        if self.world_size == 1:
            return self.proc.pid
        for pid in _children(self.proc.pid):
            if _environ(pid).get("RANK") == str(rank):
                return pid
        raise RunnerError(f"{self.name} run: no worker process of rank {rank} found")

    def rank_exits(self) -> dict[int, int]:
        """rank -> exit code, from each rank's "rank R of N: exit C" line."""
        if self.world_size == 1:
            return {0: self.proc.returncode}
        return {
            int(rank): int(code)
            for rank, size, code in _EXIT.findall(self.output())
            if int(size) == self.world_size
        }

    def expect_exits(self, code: int) -> None:
        """Wait for the job; every rank must have exited `code` (torchrun itself exits 1
        when its workers exit 75)."""
        launcher = self.wait()
        exits = self.rank_exits()
        if exits != dict.fromkeys(range(self.world_size), code) or (
            code == EXIT_OK and launcher != EXIT_OK
        ):
            raise RunnerError(
                f"{self.name} run on {self.world_size} ranks exited {launcher}, ranks {exits}; "
                f"expected {code} on every rank:\n{self.output()[-3000:]}"
            )

    def kill(self) -> None:
        """SIGKILL the ranks (each in its own session under torchrun), then the launcher."""
        if self.proc.poll() is None:
            for pid in _children(self.proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()
        self.proc.wait()


def _children(pid: int) -> list[int]:
    found: set[int] = set()
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            found.update(int(c) for c in Path(path).read_text().split())
        except OSError:
            continue
    return sorted(found)


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _start(name: str, work_dir: Path, world_size: int, run_dir: Path, **args: int) -> _Job:
    samples = work_dir / f"{name}.samples.jsonl"
    demo = _demo_args(run_dir, samples, **args)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd = [sys.executable, *launcher, str(world_size), *demo] if world_size > 1 else [
        sys.executable, *demo,
    ]  # fmt: skip
    log = work_dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=work_dir, stdout=out, stderr=subprocess.STDOUT)
    return _Job(name, world_size, run_dir, samples, proc, log)


def _stop_last_rank_at(job: _Job, step: int) -> int:
    """SIGTERM to the job's last rank once rank 0's loss log reaches `step`; returns the step
    of the checkpoint every rank stopped at."""
    deadline = time.monotonic() + SIGTERM_TIMEOUT_SECONDS
    log = LossLog(job.run_dir)
    while max(log.read(), default=0) < step:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            raise RunnerError(f"{job.name} run never reached step {step}:\n{job.output()[-3000:]}")
        time.sleep(0.02)
    os.kill(job.rank_pid(job.world_size - 1), signal.SIGTERM)
    job.expect_exits(EXIT_PREEMPTED)
    return list_checkpoints(FileStorage(job.run_dir))[-1]


def _rescale(straight: _Job, stopped: _Job, job: _Job) -> Rescaled:
    """Audit `job`: the stopped run's checkpoint resumed at another world size, finished."""
    job.expect_exits(EXIT_OK)
    storage = FileStorage(job.run_dir)
    final = read_manifest(storage, list_checkpoints(storage)[-1])
    first = min((line["step"] for line in read_samples(job.samples)), default=final.step + 1)
    return Rescaled(
        world_size=job.world_size,
        resumed_at_step=first - 1,
        final_step=final.step,
        samples_seen=final.samples_seen,
        fingerprint=final.fingerprint,
        samples=audit_samples(straight=straight.samples, before=stopped.samples, after=job.samples),
    )


def run_ranked_drill(
    *, work_dir: Path, steps: int, seed: int, stop_at: int, ranks: int, resume_ranks: int
) -> RankedDrillReport:
    """The three audits; independent launches run side by side (a launch is mostly waiting
    for torch to import)."""
    args = {"steps": steps, "seed": seed, "every": max(1, steps // 3)}
    work_dir.mkdir(parents=True, exist_ok=True)
    jobs: list[_Job] = []
    try:
        straight = _start("straight", work_dir, ranks, work_dir / "straight", **args)
        jobs.append(straight)
        stopped = _start("stopped", work_dir, ranks, work_dir / "resumed", **args)
        jobs.append(stopped)
        stopped_at = _stop_last_rank_at(stopped, stop_at)
        stopped_samples = read_manifest(FileStorage(stopped.run_dir), stopped_at).samples_seen
        shutil.copytree(stopped.run_dir, work_dir / "rescaled")
        resumed = _start("resumed", work_dir, ranks, stopped.run_dir, **args)
        jobs.append(resumed)
        rescaled = _start("rescaled", work_dir, resume_ranks, work_dir / "rescaled", **args)
        jobs.append(rescaled)
        straight.expect_exits(EXIT_OK)
        resumed.expect_exits(EXIT_OK)
        audit = _rescale(straight, stopped, rescaled)
    finally:
        for job in jobs:
            job.kill()
    storage = FileStorage(straight.run_dir)
    return RankedDrillReport(
        ranks=ranks,
        base=DrillReport(
            steps=steps,
            stopped_at=stopped_at,
            straight=outcome(straight.run_dir),
            resumed=outcome(stopped.run_dir),
        ),
        straight_samples=read_manifest(storage, list_checkpoints(storage)[-1]).samples_seen,
        stopped_samples=stopped_samples,
        rescaled=audit,
    )
