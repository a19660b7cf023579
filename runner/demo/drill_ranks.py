"""`runner drill --ranks N`: the resume audit of a multi-rank job under torchrun.

A straight N-rank run; the same job with SIGTERM to one rank (the last) and a resume at N
ranks, which must match the straight run exactly; and the stopped checkpoint resumed at M
ranks in a copy of its run dir, which must end at the straight run's samples_seen having
consumed every sample exactly once (audited from the demo's per-rank sample logs). The
fingerprints of different world sizes are not compared: the gradients' float sums are
reduced in another order, so the weights differ in their last bits.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.sidecars import LossLog
from runner.demo.drill import SIGTERM_TIMEOUT_SECONDS, DrillReport, outcome
from runner.errors import EXIT_OK, EXIT_PREEMPTED, RunnerError
from runner.storage.file import FileStorage

BATCH_SIZE = 4  # per rank: small, so a launch's time is mostly torch's start
RUN_TIMEOUT_SECONDS = 600.0
FINGERPRINT_NOTE = (
    "not compared with the straight run's: at another world size the gradients' float sums "
    "are reduced in another order"
)
ABLATIONS_SKIPPED = "the omission table is single-process: run `runner drill` without --ranks"

Sample = tuple[int, int]  # (epoch, dataset index)
_EXIT = re.compile(r"rank (\d+) of (\d+): exit (-?\d+)")


@dataclass(frozen=True, kw_only=True)
class Rescaled:
    """The stopped checkpoint resumed at another world size, to the end of the run."""

    world_size: int
    resumed_at_step: int
    final_step: int
    samples_seen: int
    fingerprint: str
    duplicated: int
    missing: int
    unexpected: int

    @property
    def exactly_once(self) -> bool:
        return self.duplicated == self.missing == self.unexpected == 0


@dataclass(frozen=True, kw_only=True)
class RankedDrillReport:
    ranks: int
    base: DrillReport  # the straight and the N-rank resumed runs
    straight_samples: int
    stopped_samples: int
    rescaled: Rescaled

    @property
    def samples_equal(self) -> bool:
        return self.rescaled.samples_seen == self.straight_samples

    @property
    def exact(self) -> bool:
        return self.base.exact

    def failure(self) -> str | None:
        """Why the audit failed (the message of the IntegrityError), None when it passed."""
        if not self.base.exact:
            return "the resumed run differs from the straight run: resume is not exact"
        if not self.samples_equal:
            return (
                f"resumed at {self.rescaled.world_size} ranks the run ended at samples_seen "
                f"{self.rescaled.samples_seen}, the straight run at {self.straight_samples}"
            )
        if not self.rescaled.exactly_once:
            return (
                f"resumed at {self.rescaled.world_size} ranks, samples were not consumed "
                f"exactly once: {self.rescaled.duplicated} twice, {self.rescaled.missing} "
                f"skipped, {self.rescaled.unexpected} not in the straight run"
            )
        return None


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


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every line the demo's --sample-log wrote at `path` (one process) and `path.rank<R>`."""
    lines = []
    for file in [path, *sorted(path.parent.glob(f"{path.name}.rank*"))]:
        if file.exists():
            lines += [json.loads(line) for line in file.read_text().splitlines() if line]
    return lines


def _consumed(lines: list[dict[str, Any]]) -> Counter[Sample]:
    return Counter((line["epoch"], index) for line in lines for index in line["indices"])


def _rescale(stopped: _Job, straight: Counter[Sample], job: _Job) -> Rescaled:
    """Audit `job`: the stopped run's checkpoint resumed at another world size, finished."""
    job.expect_exits(EXIT_OK)
    lines = read_samples(job.samples)
    consumed = _consumed(read_samples(stopped.samples)) + _consumed(lines)
    storage = FileStorage(job.run_dir)
    final = read_manifest(storage, list_checkpoints(storage)[-1])
    return Rescaled(
        world_size=job.world_size,
        resumed_at_step=min((line["step"] for line in lines), default=final.step + 1) - 1,
        final_step=final.step,
        samples_seen=final.samples_seen,
        fingerprint=final.fingerprint,
        duplicated=sum(n - 1 for n in consumed.values() if n > 1),
        missing=len(straight.keys() - consumed.keys()),
        unexpected=len(consumed.keys() - straight.keys()),
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
        audit = _rescale(stopped, _consumed(read_samples(straight.samples)), rescaled)
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


def report_json(report: RankedDrillReport) -> str:
    base, rescaled = report.base, report.rescaled
    return json.dumps(
        {
            "steps": base.steps,
            "world_sizes": {
                "straight": report.ranks,
                "resumed": report.ranks,
                "rescaled": rescaled.world_size,
            },
            "stopped_at": base.stopped_at,
            "stopped_rank": report.ranks - 1,
            "exact": base.exact,
            "straight_fingerprint": base.straight.fingerprint,
            "resumed_fingerprint": base.resumed.fingerprint,
            "rescaled": {
                "world_size": rescaled.world_size,
                "resumed_at_step": rescaled.resumed_at_step,
                "final_step": rescaled.final_step,
                "stopped_samples_seen": report.stopped_samples,
                "samples_seen": rescaled.samples_seen,
                "straight_samples_seen": report.straight_samples,
                "samples_equal": report.samples_equal,
                "exactly_once": rescaled.exactly_once,
                "duplicated": rescaled.duplicated,
                "missing": rescaled.missing,
                "unexpected": rescaled.unexpected,
                "fingerprint": rescaled.fingerprint,
                "fingerprint_note": FINGERPRINT_NOTE,
            },
            "ablations": [],
            "ablations_skipped": ABLATIONS_SKIPPED,
        },
        indent=2,
    )


def report_text(report: RankedDrillReport) -> str:
    base, rescaled, n, m = report.base, report.rescaled, report.ranks, report.rescaled.world_size
    verdict = "IDENTICAL" if base.exact else "DIFFERENT"
    samples = "EQUAL" if report.samples_equal else "DIFFERENT"
    once = (
        "every sample consumed exactly once"
        if rescaled.exactly_once
        else f"{rescaled.duplicated} samples twice, {rescaled.missing} skipped, "
        f"{rescaled.unexpected} not in the straight run"
    )
    return (
        f"straight {base.steps} steps on {_ranks(n)} vs SIGTERM to rank {n - 1} at step "
        f"{base.stopped_at} + resume on {_ranks(n)}: {verdict}\n"
        f"  fingerprint straight {base.straight.fingerprint[:16]}  "
        f"resumed {base.resumed.fingerprint[:16]}\n"
        f"  loss history: {base.loss_verdict()}\n"
        f"the step {base.stopped_at} checkpoint ({_ranks(n)}) resumed on {_ranks(m)}: "
        f"step {base.stopped_at} -> {rescaled.resumed_at_step}, ended at step "
        f"{rescaled.final_step}\n"
        f"  samples_seen {rescaled.samples_seen} vs straight {report.straight_samples}: "
        f"{samples}\n"
        f"  samples across the change ({report.stopped_samples} on {n}, the rest on {m}): "
        f"{once}\n"
        f"  fingerprint {rescaled.fingerprint[:16]}: {FINGERPRINT_NOTE}\n\n"
        f"{ABLATIONS_SKIPPED[0].upper()}{ABLATIONS_SKIPPED[1:]} (skipped for --ranks {n})."
    )


def _ranks(n: int) -> str:
    return "1 rank" if n == 1 else f"{n} ranks"
