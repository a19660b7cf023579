"""How long a checkpoint blocks the training loop, async against sync and DCP, in one run.

One train state, a real model and AdamW (default 120M parameters: 15 Linear layers, weights +
AdamW m and v = 1.44 GB, the seeds' ANDREA-120M size), is saved in every way below, one after
the other in the same process, so that each figure sees the same machine:

  copy          the floor: the state's tensors copied into host buffers allocated once
                (first: into fresh buffers; warm: into the same buffers again)
  sync          Checkpointer + SyncSaver: capture, serialise + sha256 + fsync + commit; the
                loop is blocked for all of it
  async         Checkpointer + BackgroundSaver + HostBuffers (what --save-mode async runs):
                the loop is blocked for the copy into the reused host buffers (first save:
                they are allocated). Each save starts after the previous one committed, so no
                wait is counted; `persist` is how long the background half took. VmRSS is
                read before the first, after the first and after the last of --saves saves.
  back-to-back  async saves started right after each other: each waits for the previous one
                (that wait is stall too), so this is what a too-short cadence costs
  dcp           torch.distributed.checkpoint.async_save (one process, no process group, its
                default stager; each future waited for before the next save)
  dcp cached    the same with FileSystemWriter(cache_staged_state_dict=True), DCP's own reused
                staging buffers (they are pinned: unavailable without an accelerator)

then training throughput: the model trained in a real loop, one TrainSession per mode on the
same state (loss log, retention, the policy's cadence): a checkpoint every N steps in async
mode, the same with the save at the loop's own priority (async-normal: the ablation of the
background save's lower priority, runner.system.priority), in sync mode, and none. N is
chosen so that a sync save would cost ~10% of the steps' time (N = sync save / (0.1 x step
time), measured above) unless --every says. The modes take
turns of N steps, one each per round, the order rotated every round (a drifting machine slows
them alike; each round's ratios compare neighbours in time); a turn begins with its mode's
save, so that an async save's background half runs in its own turn. Round 0 is a warm-up
(first saves allocate); --cycles rounds are counted.

The loop and every copy use --threads torch threads (default 1: on a 2-core machine the other
core is left to the background save; it still competes for memory bandwidth and the GIL).

Last, the newest async and sync checkpoints are verified and their fingerprints compared with
the live state's (the state did not change between them).

Usage: python benchmarks/stall.py [--params 120000000] [--saves 20] [--every N] [--json]
       [--dir PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runner.checkpoint.verify import verify_dir  # noqa: E402
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint  # noqa: E402
from runner.config import RunConfig  # noqa: E402
from runner.session.background import BackgroundSaver  # noqa: E402
from runner.session.checkpointer import Checkpointer  # noqa: E402
from runner.session.train_session import TrainSession  # noqa: E402
from runner.state.counters import Counters  # noqa: E402
from runner.state.host_copy import HostBuffers  # noqa: E402
from runner.state.train_state import ModuleTrainState  # noqa: E402

LAYERS = 15  # a 120M model is 15 matrices of ~8M parameters (as benchmarks/save.py's state)
SYNC_COST = 0.1  # N is chosen so that a sync save every N steps costs this share of the time
# "async-normal" is the ablation of the background save's lower priority (runner.system.priority)
MODES = ("none", "async", "async-normal", "sync")

Results = dict[str, Any]  # JSON-able


# -- the state -------------------------------------------------------------------------------


class Bench:
    """A model of ~n_params parameters with AdamW, its state, and one fixed input batch."""

    def __init__(self, n_params: int, *, batch: int) -> None:
        self.width = max(2, math.isqrt(n_params // LAYERS))
        gen = torch.Generator().manual_seed(0)
        layers: list[torch.nn.Module] = []
        for i in range(LAYERS):
            layers.append(torch.nn.Linear(self.width, self.width))
            if i < LAYERS - 1:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers)
        self.params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.state = ModuleTrainState(model=model, optimizer=optimizer)
        self.inputs = torch.randn(batch, self.width, generator=gen)

    @property
    def state_bytes(self) -> int:
        """Weights + AdamW m and v (how the issue sizes a state: 12 bytes a parameter)."""
        return 3 * 4 * self.params

    def step(self) -> None:
        state = self.state
        loss = state.model(self.inputs).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.advance(loss=float(loss.detach()), samples=len(self.inputs))

    def fresh_counters(self) -> None:
        """Step 0 again (a new run dir's session starts there; the tensors stay as they are)."""
        self.state.counters = Counters()
        self.state.loss_history = []


def tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensors_in(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from tensors_in(value)


def vm_rss() -> int:
    """This process's resident memory in bytes (/proc/self/status VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


_STARTED = time.perf_counter()


def _progress(message: str) -> None:
    """Where a long run is (stderr, so that --json's stdout stays JSON)."""
    print(f"[{time.perf_counter() - _STARTED:6.0f} s] {message}", file=sys.stderr, flush=True)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def choose_every(sync_seconds: float, step_seconds: float, *, cost: float = SYNC_COST) -> int:
    """Steps between checkpoints so that a sync save costs `cost` of the steps' time."""
    return max(1, round(sync_seconds / (cost * step_seconds)))


# -- the measurements ------------------------------------------------------------------------


def measure_steps(bench: Bench, *, steps: int) -> Results:
    """The first step (AdamW creates m and v), then `steps` timed ones."""
    first, _ = timed(bench.step)
    seconds = [timed(bench.step)[0] for _ in range(steps)]
    return {"first_seconds": first, "seconds": seconds}


def measure_copy(bench: Bench, *, rounds: int) -> Results:
    """The state's tensors (as a save captures them) into preallocated host buffers."""
    sources = list(tensors_in(bench.state.capture()))
    copied_bytes = sum(t.untyped_storage().nbytes() for t in sources)

    def first() -> list[torch.Tensor]:
        buffers = [torch.empty_like(t) for t in sources]
        for buffer, t in zip(buffers, sources, strict=True):
            buffer.copy_(t)
        return buffers

    first_seconds, buffers = timed(first)

    def again(into: list[torch.Tensor]) -> None:
        for buffer, t in zip(into, sources, strict=True):
            buffer.copy_(t)

    warm = [timed(lambda: again(buffers))[0] for _ in range(rounds)]
    return {"first_seconds": first_seconds, "warm_seconds": warm, "bytes": copied_bytes}


def _checkpointer(run_dir: Path, *, background: bool) -> Checkpointer:
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="bench", writer_id="bench")
    if background:
        return Checkpointer(writer, saver=BackgroundSaver, snapshot_to=HostBuffers())
    return Checkpointer(writer)


def _drop(previous: CommittedCheckpoint | None) -> None:
    """A benchmark keeps one checkpoint: 20 of 1.44 GB would not fit on every disk."""
    if previous is not None:
        shutil.rmtree(previous.path)


def measure_sync(bench: Bench, run_dir: Path, *, saves: int) -> tuple[Results, Path]:
    ckpt = _checkpointer(run_dir, background=False)
    seconds: list[float] = []
    last: CommittedCheckpoint | None = None
    try:
        for _ in range(saves):
            bench.state.counters.step += 1
            gc.collect()
            pending = ckpt.save(bench.state, reason="bench")
            assert ckpt.last_stall_seconds is not None
            seconds.append(ckpt.last_stall_seconds)
            _drop(last)
            last = pending.result()
    finally:
        ckpt.close()
    assert last is not None
    return {"seconds": seconds}, last.path


def measure_async(
    bench: Bench, run_dir: Path, *, saves: int, back_to_back: int
) -> tuple[Results, Path]:
    """`saves` saves, each after the previous committed (RSS read around them), then
    `back_to_back` more, each started as soon as the previous one returned."""
    ckpt = _checkpointer(run_dir, background=True)
    assert ckpt.snapshot_to is not None
    stalls: list[float] = []
    persist: list[float] = []
    rss: dict[str, int] = {}
    last: CommittedCheckpoint | None = None
    try:
        gc.collect()
        rss["before"] = vm_rss()
        for i in range(saves):
            bench.state.counters.step += 1
            started = time.perf_counter()
            pending = ckpt.save(bench.state, reason="bench")
            assert ckpt.last_stall_seconds is not None
            stalls.append(ckpt.last_stall_seconds)
            committed = pending.result()  # not stall: the loop would train meanwhile
            persist.append(time.perf_counter() - started)
            _drop(last)
            last = committed
            if i == 0:
                rss["after_first"] = vm_rss()
        gc.collect()
        rss["after"] = vm_rss()
        buffer_bytes = ckpt.snapshot_to.nbytes
        queued: list[Any] = []
        b2b: list[float] = []
        for i in range(back_to_back):
            bench.state.counters.step += 1
            queued.append(ckpt.save(bench.state, reason="bench"))
            assert ckpt.last_stall_seconds is not None
            if i > 0:  # the first had nothing in flight before it
                b2b.append(ckpt.last_stall_seconds)
        for pending in queued:
            committed = pending.result()
            _drop(last)
            last = committed
    finally:
        ckpt.close()
    assert last is not None
    results = {
        "stall_seconds": stalls,
        "persist_seconds": persist,
        "back_to_back_stall_seconds": b2b,
        "buffer_bytes": buffer_bytes,
        "rss_bytes": rss,
    }
    return results, last.path


def measure_dcp(bench: Bench, base: Path, *, saves: int, cached: bool) -> Results:
    """DCP async_save of the model's and optimizer's state dicts; stall = the call itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    stalls: list[float] = []
    persist: list[float] = []
    writer: FileSystemWriter | None = None
    try:
        for i in range(saves):
            target = base / f"dcp-{i}"
            state_dict = {
                "model": bench.state.model.state_dict(),
                "optimizer": bench.state.optimizer.state_dict(),
            }
            options: dict[str, Any] = {"checkpoint_id": target, "no_dist": True}
            if cached:
                # the writer is its own stager: it keeps its staging copy for later saves
                if writer is None:
                    writer = FileSystemWriter(target, cache_staged_state_dict=True)
                options["storage_writer"] = writer
            gc.collect()
            started = time.perf_counter()
            future = dcp.async_save(state_dict, **options)
            stalls.append(time.perf_counter() - started)
            assert isinstance(future, Future)  # the blocking stagers' kind of response
            future.result()
            persist.append(time.perf_counter() - started)
            del state_dict
            if i > 0:
                shutil.rmtree(base / f"dcp-{i - 1}")
        shutil.rmtree(base / f"dcp-{saves - 1}", ignore_errors=True)
    except RuntimeError as exc:
        if not cached:
            raise
        # the cached stager pins its buffers: without an accelerator there is none to pin
        return {"unavailable": f"{type(exc).__name__}: {exc}"}
    finally:
        for leftover in base.glob("dcp-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return {"stall_seconds": stalls, "persist_seconds": persist}


def measure_training(bench: Bench, base: Path, *, every: int, cycles: int) -> Results:
    """Steps/s of the loop under three TrainSessions on the same state, one per mode: a
    checkpoint every `every` steps in async mode, in sync mode, and none.

    The modes take turns of `every` steps (a round: one turn each, the order rotated every
    round), so that a machine whose speed drifts slows them alike and each round's ratios
    compare neighbours in time. A turn starts at a multiple of `every`: a saving mode saves
    after its turn's first step, and an async save's background half runs inside its own
    turn (`persisted_in_turn` says whether it ended there). Round 0 is the warm-up (the first
    saves allocate, the page cache settles) and is not counted."""
    bench.fresh_counters()
    sessions: dict[str, TrainSession] = {}
    try:
        for mode in MODES:
            config = RunConfig(
                run_dir=base / f"train-{mode}",
                ckpt_every=None if mode == "none" else every,
                save_mode="sync" if mode == "sync" else "async",
                keep=2,
                writer_id=f"bench-{mode}",
            )
            sessions[mode] = TrainSession(config, state=bench.state)
            if mode == "async-normal":
                _normal_priority(sessions[mode].checkpointer)
            sessions[mode].restore()  # a fresh run dir: nothing to restore
        for _ in range(every - 1):  # to the first multiple of `every`
            bench.step()
            sessions["none"].step_done()
        rounds: list[Results] = []
        for round_no in range(1 + cycles):
            one: Results = {}
            for i in range(len(MODES)):
                mode = MODES[(i + round_no) % len(MODES)]
                one[mode] = _turn(bench, sessions[mode], mode=mode, steps=every)
            rounds.append({mode: one[mode] for mode in MODES})
    finally:
        for session in sessions.values():
            session.close()  # a save in flight ends; no final checkpoint (not part of a turn)
        for mode in MODES:
            shutil.rmtree(base / f"train-{mode}", ignore_errors=True)
    return {"warmup": rounds[0], "rounds": rounds[1:]}


def _normal_priority(checkpointer: Checkpointer) -> None:
    """The ablation: the same background saver, its thread at the loop's own priority."""
    checkpointer.saver.close()
    checkpointer.saver = BackgroundSaver(checkpointer.persist, low_priority=False)


def _turn(bench: Bench, session: TrainSession, *, mode: str, steps: int) -> Results:
    stalls: list[float] = []
    durations: list[float] = []  # each step + its step_done
    saving: list[bool] = []  # an async save still in flight after that step
    saver = session.checkpointer.saver
    gc.collect()
    started = time.perf_counter()
    for _ in range(steps):
        step_started = time.perf_counter()
        bench.step()
        session.step_done()
        durations.append(time.perf_counter() - step_started)
        saving.append(isinstance(saver, BackgroundSaver) and saver.in_flight)
        if mode != "none" and session.step % steps == 0:
            assert session.last_stall_seconds is not None
            stalls.append(session.last_stall_seconds)
    seconds = time.perf_counter() - started
    turn: Results = {
        "steps": steps,
        "seconds": seconds,
        "steps_per_second": steps / seconds,
        "stall_seconds": stalls,
        "step_seconds": durations,
    }
    if mode.startswith("async"):
        turn["persisted_in_turn"] = not saving[-1]
        turn["steps_while_saving"] = sum(saving)
    return turn


def steady_share(turn: Results) -> float:
    """The share of a turn's time its steady steps would take: steps x the median step after
    the save (and, async, its background half) had ended, over the turn's time. Its ratio to
    the same round's none turn is a second throughput estimate, one that compares steps
    seconds apart rather than turns a minute apart (less exposed to a drifting machine)."""
    durations = turn["step_seconds"]
    after = 1 + turn.get("steps_while_saving", 0)  # the first step carries the save
    steady = durations[after:] or durations
    return len(durations) * statistics.median(steady) / sum(durations)


def verify_same_state(bench: Bench, async_dir: Path, sync_dir: Path) -> Results:
    """Both newest checkpoints verify and hold the live state (unchanged since they were
    taken: only counters moved between them)."""
    live = bench.state.fingerprint()
    async_fp = verify_dir(async_dir).fingerprint
    sync_fp = verify_dir(sync_dir).fingerprint
    return {
        "async_verifies": True,  # verify_dir raises otherwise
        "sync_verifies": True,
        "async_fingerprint_is_live": async_fp == live,
        "sync_fingerprint_is_live": sync_fp == live,
    }


# -- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, base: Path) -> Results:
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # a deep ReLU net's tiny values must not slow the steps
    bench = Bench(args.params, batch=args.batch)
    results: Results = {
        "state": {
            "params": bench.params,
            "layers": LAYERS,
            "width": bench.width,
            "state_bytes": bench.state_bytes,
            "batch": args.batch,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
        }
    }
    _progress(f"state built: {bench.params:,} parameters; steps")
    results["steps"] = measure_steps(bench, steps=args.step_samples)
    _progress("copy into preallocated buffers")
    results["copy"] = measure_copy(bench, rounds=args.copies)
    _progress(f"{args.sync_saves} sync saves")
    results["sync"], sync_dir = measure_sync(bench, base / "sync", saves=args.sync_saves)
    _progress(f"{args.saves} async saves, then {args.back_to_back} back to back")
    results["async"], async_dir = measure_async(
        bench, base / "async", saves=args.saves, back_to_back=args.back_to_back
    )
    _progress("verifying the newest async and sync checkpoints")
    results["checks"] = verify_same_state(bench, async_dir, sync_dir)
    shutil.rmtree(base / "sync")
    shutil.rmtree(base / "async")
    _progress(f"{args.dcp_saves} DCP async_save, default stager, then cached")
    results["dcp"] = measure_dcp(bench, base, saves=args.dcp_saves, cached=False)
    results["dcp_cached"] = measure_dcp(bench, base, saves=args.dcp_saves, cached=True)

    step_seconds = statistics.median(results["steps"]["seconds"])
    sync_seconds = statistics.median(results["sync"]["seconds"])
    every = args.every or choose_every(sync_seconds, step_seconds)
    _progress(f"training: {args.cycles} rounds of one {every}-step turn per mode (+ warm-up)")
    training = measure_training(bench, base, every=every, cycles=args.cycles)
    results["training"] = {
        "every": every,
        "every_from": "--every" if args.every else "sync save / (0.1 x step time)",
        "cycles": args.cycles,
        **training,
    }
    results["summary"] = summarise(results)
    _progress("done")
    return results


def _warm(seconds: list[float]) -> float:
    """The median of all but the first (which allocates), or the only one."""
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def summarise(results: Results) -> Results:
    copy = statistics.median(results["copy"]["warm_seconds"])
    sync = _warm(results["sync"]["seconds"])
    stalls = results["async"]["stall_seconds"]
    warm_stall = _warm(stalls)
    rss = results["async"]["rss_bytes"]
    state_bytes = results["state"]["state_bytes"]
    summary: Results = {
        "copy_seconds": copy,
        "sync_seconds": sync,
        "async_first_stall_seconds": stalls[0],
        "async_warm_stall_seconds": warm_stall,
        "async_max_warm_stall_seconds": max(stalls[1:] or stalls),
        "async_persist_seconds": _warm(results["async"]["persist_seconds"]),
        "warm_stall_over_copy": warm_stall / copy,
        "warm_stall_over_sync": warm_stall / sync,
        "first_stall_over_sync": stalls[0] / sync,
        "buffers_over_state": results["async"]["buffer_bytes"] / state_bytes,
        "rss_growth_first_save_over_state": (rss["after_first"] - rss["before"]) / state_bytes,
        "rss_growth_later_saves_bytes": rss["after"] - rss["after_first"],
    }
    if results["async"]["back_to_back_stall_seconds"]:
        b2b = statistics.median(results["async"]["back_to_back_stall_seconds"])
        summary["back_to_back_stall_seconds"] = b2b
        summary["back_to_back_stall_over_sync"] = b2b / sync
    for key in ("dcp", "dcp_cached"):
        dcp = results[key]
        if "stall_seconds" in dcp:
            summary[f"{key}_first_stall_seconds"] = dcp["stall_seconds"][0]
            summary[f"{key}_warm_stall_seconds"] = _warm(dcp["stall_seconds"])
            summary[f"{key}_warm_stall_over_copy"] = _warm(dcp["stall_seconds"]) / copy
            summary[f"async_warm_stall_over_{key}_warm_stall"] = warm_stall / _warm(
                dcp["stall_seconds"]
            )
    rounds = results["training"]["rounds"]
    for mode in MODES[1:]:
        ratios = [r[mode]["steps_per_second"] / r["none"]["steps_per_second"] for r in rounds]
        summary[f"throughput_{mode}_over_none"] = statistics.median(ratios)
        summary[f"throughput_{mode}_over_none_rounds"] = ratios
        # all rounds together: steps over seconds, each mode's turns summed
        totals = [sum(r[m][key] for r in rounds) for m in (mode, "none") for key in _RATE]
        summary[f"throughput_{mode}_over_none_total"] = (totals[0] / totals[1]) / (
            totals[2] / totals[3]
        )
        shares = [steady_share(r[mode]) / steady_share(r["none"]) for r in rounds]
        summary[f"steady_share_{mode}_over_none"] = statistics.median(shares)
        summary[f"steady_share_{mode}_over_none_rounds"] = shares
        in_loop = [s for r in rounds for s in r[mode]["stall_seconds"]]
        summary[f"training_{mode}_stall_seconds"] = statistics.median(in_loop)
        summary[f"training_{mode}_first_stall_seconds"] = results["training"]["warmup"][mode][
            "stall_seconds"
        ][0]
        if mode.startswith("async"):
            summary[f"training_{mode}_persisted_in_turn"] = sum(
                r[mode]["persisted_in_turn"] for r in rounds
            )
    # how much slower the steps ran while an async save's background half ran beside them
    during = [d for r in rounds for d in _while_saving(r["async"])]
    steady = [
        d
        for r in rounds
        for d in r["async"]["step_seconds"][1 + r["async"]["steps_while_saving"] :]
    ]
    if during and steady:  # none when a save outlasts its whole turn (N too small)
        summary["steps_while_saving_over_steady"] = statistics.median(during) / statistics.median(
            steady
        )
    summary["step_seconds"] = statistics.median(
        r["none"]["seconds"] / r["none"]["steps"] for r in rounds
    )
    return summary


_RATE = ("steps", "seconds")


def _while_saving(turn: Results) -> list[float]:
    """The step times of an async turn after its first step while its save was in flight."""
    return turn["step_seconds"][1 : 1 + turn["steps_while_saving"]]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"


def report(results: Results) -> list[str]:
    """The table a plain run prints, from the --json figures."""
    state, s = results["state"], results["summary"]
    training = results["training"]
    rss = results["async"]["rss_bytes"]
    lines = [
        f"stall: {state['params']:,} parameters ({state['layers']} Linear layers of "
        f"{state['width']}), {state['state_bytes'] / 1e9:.2f} GB with AdamW m and v; "
        f"{state['torch_threads']} torch thread(s) on {state['cpus']} CPUs",
        f"{'':34} {'ms':>8}",
        f"{'copy into preallocated buffers':34} {_ms(s['copy_seconds'])}",
        f"{'sync save (whole save)':34} {_ms(s['sync_seconds'])}",
        f"{'async stall, first save':34} {_ms(s['async_first_stall_seconds'])}",
        f"{'async stall, warm (median)':34} {_ms(s['async_warm_stall_seconds'])}",
        f"{'async stall, warm (max)':34} {_ms(s['async_max_warm_stall_seconds'])}",
        f"{'async persist (background)':34} {_ms(s['async_persist_seconds'])}",
    ]
    if "back_to_back_stall_seconds" in s:
        lines.append(
            f"{'async stall, back-to-back saves':34} {_ms(s['back_to_back_stall_seconds'])}"
        )
    for key, label in (("dcp", "DCP async_save"), ("dcp_cached", "DCP async_save, cached")):
        if f"{key}_warm_stall_seconds" in s:
            lines.append(f"{label + ' stall, first':34} {_ms(s[f'{key}_first_stall_seconds'])}")
            lines.append(f"{label + ' stall, warm':34} {_ms(s[f'{key}_warm_stall_seconds'])}")
        else:
            lines.append(f"{label:34} unavailable ({results[key]['unavailable']})")
    lines += [
        f"ratio: async warm stall / copy           {s['warm_stall_over_copy']:.2f}x (target <= 2x)",
        f"ratio: async warm stall / sync save      {s['warm_stall_over_sync']:.3f}x",
        f"ratio: async first stall / sync save     {s['first_stall_over_sync']:.3f}x",
    ]
    if "back_to_back_stall_over_sync" in s:
        lines.append(
            f"ratio: back-to-back stall / sync save    {s['back_to_back_stall_over_sync']:.2f}x"
        )
    for key, label in (("dcp", "DCP"), ("dcp_cached", "DCP cached")):
        if f"{key}_warm_stall_over_copy" in s:
            lines.append(
                f"ratio: {label + ' warm stall / copy':33}{s[f'{key}_warm_stall_over_copy']:.2f}x"
            )
            lines.append(
                f"ratio: {'async / ' + label + ' warm stall':33}"
                f"{s[f'async_warm_stall_over_{key}_warm_stall']:.2f}x"
            )
    lines += [
        f"memory: host buffers {results['async']['buffer_bytes'] / 1e9:.3f} GB = "
        f"{s['buffers_over_state']:.3f}x the state; VmRSS +"
        f"{(rss['after_first'] - rss['before']) / 1e9:.3f} GB at the first save, "
        f"{s['rss_growth_later_saves_bytes'] / 1e6:+.1f} MB over the next "
        f"{len(results['async']['stall_seconds']) - 1} saves",
        f"training: a checkpoint every {training['every']} steps ({training['every_from']}), "
        f"step {s['step_seconds'] * 1e3:.0f} ms; {len(training['rounds'])} rounds of one "
        f"{training['every']}-step turn per mode (after a warm-up round)",
    ]
    for mode in MODES:
        rates = [r[mode]["steps_per_second"] for r in training["rounds"]]
        line = f"{'  ' + mode:34} {statistics.median(rates):8.3f} steps/s (median turn)"
        if mode != "none":
            line += (
                f", stall {s[f'training_{mode}_stall_seconds'] * 1e3:.0f} ms "
                f"(first save {s[f'training_{mode}_first_stall_seconds'] * 1e3:.0f} ms)"
            )
        if mode.startswith("async"):
            line += (
                f", background save done within its turn "
                f"{s[f'training_{mode}_persisted_in_turn']}"
                f"/{len(training['rounds'])}"
            )
        lines.append(line)
    targets = {"async": " (target >= 0.98x)", "sync": " (~0.91x by the choice of N)"}
    for mode in MODES[1:]:
        each = ", ".join(f"{r:.3f}" for r in s[f"throughput_{mode}_over_none_rounds"])
        target = targets.get(mode, " (ablation: save at the loop's priority)")
        lines.append(
            f"ratio: throughput {mode} / none{'':{max(1, 12 - len(mode))}}"
            f"{s[f'throughput_{mode}_over_none']:.3f}x{target}; per round {each}; "
            f"all rounds {s[f'throughput_{mode}_over_none_total']:.3f}x"
        )
    for mode in MODES[1:]:
        each = ", ".join(f"{r:.3f}" for r in s[f"steady_share_{mode}_over_none_rounds"])
        lines.append(
            f"ratio: within-turn estimate {mode} / none{'':{max(1, 6 - len(mode))}}"
            f"{s[f'steady_share_{mode}_over_none']:.3f}x; per round {each}"
        )
    if "steps_while_saving_over_steady" in s:
        lines.append(
            "steps while an async save runs in the background: "
            f"{s['steps_while_saving_over_steady']:.2f}x the steady step time"
        )
    checks = results["checks"]
    same = checks["async_fingerprint_is_live"] and checks["sync_fingerprint_is_live"]
    lines.append(
        "the newest async and sync checkpoints verify"
        + (", both the live state's fingerprint" if same else "; FINGERPRINT MISMATCH")
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=120_000_000)
    parser.add_argument("--batch", type=int, default=16, help="the training loop's batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (loop, copies)")
    parser.add_argument("--saves", type=int, default=20, help="async saves (RSS read around)")
    parser.add_argument("--back-to-back", type=int, default=3)
    parser.add_argument("--sync-saves", type=int, default=4)
    parser.add_argument("--dcp-saves", type=int, default=5)
    parser.add_argument("--copies", type=int, default=3, help="warm copies timed")
    parser.add_argument("--step-samples", type=int, default=3, help="steps timed to choose N")
    parser.add_argument("--every", type=int, default=None, help="N (default: chosen)")
    parser.add_argument("--cycles", type=int, default=3, help="rounds of N-step turns timed")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--dir", type=Path, default=None, help="scratch dir (default: tmp)")
    args = parser.parse_args()
    # DCP's save thread warns that it assumes a single process: it is one (no_dist)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if args.saves < 2 or args.sync_saves < 1 or args.dcp_saves < 1 or args.cycles < 1:
        parser.error("--saves >= 2, --sync-saves, --dcp-saves and --cycles >= 1")

    base = Path(tempfile.mkdtemp(prefix="bench-stall-", dir=args.dir))
    try:
        results = run(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print("\n".join(report(results)))


if __name__ == "__main__":
    main()
