"""Multi-rank mechanisms measured in real torchrun launches (gloo on CPU), section by section.

Each section is a worker that runs in every rank of `torchrun --standalone --nproc-per-node N`
(started by the common launcher below, once per world size) and a report that turns rank 0's
results into a table. Sections so far:

  agreement  how the ranks agree, every step, on a stop/save seen by any one of them:
             (a) Group.agree: all-reduce MAX of an int64[2] on the runner's dedicated gloo group
             (b) store polling: `check` of a stop key on torchrun's c10d store (the rank that
                 sees a stop `set`s it); a store scheme alone cannot pick the step, see below
             (c) Group.agree every k steps (k = 4, 16), amortised per step
             each as µs per step (the slowest rank's mean) and as % of the demo's step time
             (runner.demo build_demo(seed=0, cpu, batch 16).train_step(), measured in the same
             ranks: N ranks train at once, so on a small machine it includes their contention),
             plus each inside a data-parallel loop (step + gradient-sized all-reduce +
             mechanism, minus the same loop without it).

How a store scheme would pick the step, and why it is not the runner's: a `set` is seen by each
other rank at its next poll, and nothing in the store bounds how many steps that rank has run
by then, so "stop after the step where you saw the key" differs between ranks. It can be made
to agree only by leaning on the model's own per-step collective (DDP's gradient all-reduce):
that keeps the ranks within one step of each other, so a rank that sees a stop after step s
writes "stop after s + 1" (compare_set: the first writer wins when two ranks see stops), and
every other rank reads it by the end of step s + 1 at the latest, because it cannot finish
step s + 1 before the writer joins that step's all-reduce. Without such a collective (or with
the poll anywhere but between steps) there is no bound and no agreement short of a blocking
round of store writes and waits: an all-reduce built from store calls. The store scheme also
never notices a dead peer (the store lives in the torchrun agent, which survives): the
survivors then depend on the model's next collective noticing (nccl may wait out its timeout)
instead of getting PeerLostError from the runner's own gloo channel at once.

Usage: python benchmarks/distributed.py [--ranks 2,4] [--sections agreement] [--json]
Takes about two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

Results = dict[str, Any]  # JSON-able


@dataclass(frozen=True)
class Section:
    name: str
    worker: Callable[[argparse.Namespace], Results]
    """Runs in every rank (torch.distributed initialised); rank 0's return value is kept."""
    report: Callable[[dict[int, Results]], list[str]]
    """Lines of the table from {world size: rank 0's results}."""


# ---------------------------------------------------------------------------------------------
# The common launcher


def launch(section: str, nproc: int, options: list[str], timeout: float = 600) -> Results:
    """Run `section`'s worker in `nproc` ranks under torchrun; rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        out = Path(tmp) / "results.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--log-dir", str(Path(tmp) / "logs"),
            __file__, "--worker", section, "--out", str(out), *options,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"{section} at {nproc} ranks: torchrun exited {done.returncode}\n"
                f"{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
        return json.loads(out.read_text())


def worker_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = SECTIONS[args.worker].worker(args)
        if dist.get_rank() == 0:
            Path(args.out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Section "agreement"

STOP_KEY = "runner/bench/stop"


def _timed_us(run: Callable[[], object], iterations: int) -> list[float]:
    """Each call's duration in µs."""
    times = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        run()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def _every(k: int, op: Callable[[], object]) -> Callable[[], None]:
    count = [0]

    def step() -> None:
        count[0] += 1
        if count[0] % k == 0:
            op()

    return step


def agreement_worker(args: argparse.Namespace) -> Results:
    """Every rank: each mechanism alone, then inside a data-parallel training loop (the demo's
    step plus an all-reduce of a gradient-sized buffer on the default group, as DDP does: the
    ranks are already in step, so what a mechanism adds is its own cost, not the wait for the
    slowest rank). The table keeps the slowest rank's figure: a per-step mechanism costs what
    the slowest pays. Long because it is the section's whole measurement, in order."""
    import torch
    import torch.distributed as dist

    from runner.collective import dedicated_group
    from runner.demo.components import build_demo

    group = dedicated_group(timeout_s=120)
    store = dist.distributed_c10d._get_default_store()
    demo = build_demo(seed=0, device="cpu", batch_size=16, total_steps=200)
    grads = torch.zeros(sum(p.numel() for p in demo.model.parameters()))
    flags = [0, 0]  # stop, save: what step_done would agree on
    mechanisms: dict[str, Callable[[], object]] = {
        "agree every step": lambda: group.agree(flags),
        "store check every step": lambda: store.check([STOP_KEY]),
        "agree every 4 steps": _every(4, lambda: group.agree(flags)),
        "agree every 16 steps": _every(16, lambda: group.agree(flags)),
    }

    def loop(extra: Callable[[], object] | None) -> float:
        def one() -> None:
            demo.train_step()
            dist.all_reduce(grads)  # the data-parallel step's own collective
            if extra is not None:
                extra()

        group.barrier()
        return statistics.mean(_timed_us(one, args.loop_steps))

    for _ in range(args.warmup_steps):
        demo.train_step()
    alone: dict[str, list[float]] = {}
    for name, op in mechanisms.items():
        op()
        group.barrier()
        alone[name] = _timed_us(op, args.iterations)
    # Baseline blocks interleaved with the mechanisms' blocks, against drift.
    baselines, in_loop = [loop(None)], {}
    for name, op in mechanisms.items():
        in_loop[name] = loop(op)
        baselines.append(loop(None))
    step_us = statistics.mean(baselines)
    plain = statistics.mean(_timed_us(demo.train_step, args.loop_steps))
    mine = {
        "train_step_us": plain,
        "dp_step_us": step_us,
        "mean": {n: statistics.mean(t) for n, t in alone.items()},
        "median": {n: statistics.median(t) for n, t in alone.items()},
        "in_loop": {n: us - step_us for n, us in in_loop.items()},
    }
    everyone = group.all_gather(mine)
    worst: Results = {k: max(r[k] for r in everyone) for k in ("train_step_us", "dp_step_us")}
    for key in ("mean", "median", "in_loop"):
        worst[key] = {n: max(r[key][n] for r in everyone) for n in mechanisms}
    return {"world_size": group.world_size, **worst, "iterations": args.iterations}


def agreement_report(by_world: dict[int, Results]) -> list[str]:
    lines = [
        "agreement: cost per training step (slowest rank; gloo on CPU, real processes)",
        f"{'mechanism':<24}{'ranks':>6}{'mean µs':>10}{'p50 µs':>9}{'% of step':>11}"
        f"{'in DP loop µs':>15}",
    ]
    for world, res in sorted(by_world.items()):
        step = res["train_step_us"]
        for name, us in res["mean"].items():
            p50 = f"{res['median'][name]:>9.1f}" if "every step" in name else f"{'-':>9}"
            lines.append(
                f"{name:<24}{world:>6}{us:>10.1f}{p50}{100 * us / step:>10.2f}%"
                f"{res['in_loop'][name]:>15.0f}"
            )
        lines.append(
            f"{'demo train_step':<24}{world:>6}{step:>10.0f}   (data-parallel step with its "
            f"gradient all-reduce: {res['dp_step_us']:.0f} µs)"
        )
    lines.append(
        "mean/p50: the mechanism alone, per step; % of step: mean / demo train_step; in DP loop: "
        "mean(DP step + mechanism) - mean(DP step), noisy"
    )
    return lines


SECTIONS = {
    "agreement": Section("agreement", agreement_worker, agreement_report),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--iterations", type=int, default=2000, help="per mechanism, alone")
    parser.add_argument("--loop-steps", type=int, default=60, help="training steps per block")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    options = [
        "--iterations", str(args.iterations), "--loop-steps", str(args.loop_steps),
        "--warmup-steps", str(args.warmup_steps),
    ]  # fmt: skip
    results: dict[str, dict[int, Results]] = {}
    for name in args.sections.split(","):
        results[name] = {n: launch(name, n, options) for n in map(int, args.ranks.split(","))}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, by_world in results.items():
        print("\n".join(SECTIONS[name].report(by_world)))


if __name__ == "__main__":
    main()
