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
  save       one checkpoint of the same replicated (DDP-style) state, --save-mb MB of fp32
             parameters plus AdamW m and v, by write_ranked (DCP: each tensor written by one
             rank, the writes split between them; sha256 while writing, fsync, manifest) at
             each --save-ranks world size (1 is a world of one on the same code path), and by
             torch.save + fsync in the 1-rank launch; seconds, bytes each rank wrote, the
             N-rank/1-rank ratio per round (one launch per world size per round, the order
             reversed every other round; each launch's best of --saves).
  upload     the files of one committed --upload-ranks checkpoint to a SeaweedFS started for
             the run (a file:// bucket, said so in the table, when it cannot start):
             (a) every rank puts its own files, then rank 0 the manifest, (b) rank 0 alone by
             the mirror's upload_checkpoint (per-file pool), (c) the same one file at a time;
             MB/s and ratios per round (the order rotated every round).

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

Usage: python benchmarks/distributed.py [--ranks 2,4] [--sections agreement,save,upload] [--json]
       [--save-mb 128] [--save-ranks 1,2] [--rounds 3] [--dir PATH]
Takes about two minutes a section on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
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
    run: Callable[[str, argparse.Namespace, list[str]], dict[int, Results]] | None = None
    """How the launcher runs it (section name, args, worker options); None: once per --ranks."""


# ---------------------------------------------------------------------------------------------
# The common launcher


def launch(
    section: str,
    nproc: int,
    options: list[str],
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> Results:
    """Run `section`'s worker in `nproc` ranks under torchrun (`env` added to this one's);
    rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        out = Path(tmp) / "results.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--log-dir", str(Path(tmp) / "logs"),
            __file__, "--worker", section, "--out", str(out), *options,
        ]  # fmt: skip
        env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
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


# ---------------------------------------------------------------------------------------------
# Sections "save" and "upload": one multi-rank checkpoint of a replicated (DDP-style) state

MB = 1_000_000
LAYERS = 8


def _replicated_state(save_mb: float, world_size: int) -> Any:
    """The same state on every rank, as DDP holds it: LAYERS square Linear layers of about
    `save_mb` MB of fp32 parameters, with AdamW's m and v (one step on unit gradients): about
    3 x save_mb MB of tensors, which DCP splits between the ranks (each tensor is written by
    the rank with the least planned so far)."""
    import torch

    from runner.state.train_state import ModuleTrainState

    width = max(8, round((save_mb * MB / 4 / LAYERS) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(LAYERS)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    state = ModuleTrainState(model=model, optimizer=optimizer, world_size=world_size)
    state.advance(loss=1.0, samples=world_size)
    return state


def _tensor_bytes(state: Any) -> int:
    optimizer_tensors = [
        t for entry in state.optimizer.state.values() for t in entry.values() if t.dim() > 0
    ]
    tensors = [*state.model.parameters(), *optimizer_tensors]
    return sum(t.numel() * t.element_size() for t in tensors)


def _shared_dir(group: Any, parent: str | None) -> Path:
    """A scratch dir every rank of `group` writes into (made by rank 0)."""
    made = tempfile.mkdtemp(prefix="bench-ckpt-", dir=parent) if group.rank == 0 else ""
    return Path(group.broadcast(made))


def _timed_commit(state: Any, writer: Any, group: Any, fingerprint: str) -> tuple[float, Any]:
    """Seconds to capture and commit one checkpoint on every rank (rank 0 returns once all
    ranks' files are in and the manifest is committed), and the committed checkpoint."""
    from runner.checkpoint.ranked import write_ranked
    from runner.checkpoint.writer import CheckpointMeta

    c = state.counters
    meta = CheckpointMeta(
        step=c.step,
        samples_seen=c.samples_seen,
        world_size=group.world_size,
        epoch=c.epoch,
        batch_in_epoch=c.batch_in_epoch,
        fingerprint=fingerprint,
    )
    group.barrier()
    start = time.perf_counter()
    part = state.capture_ranked(rank=group.rank, world_size=group.world_size)
    committed = write_ranked(writer, part, meta=meta, group=group)
    return time.perf_counter() - start, committed


def _torch_save_fsync(state: Any, root: Path) -> float:
    """Seconds for the plain way: torch.save of the whole captured state into one file, fsync."""
    import torch

    path = root / "plain.pt"
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state.capture(), f)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def _owner(path: str) -> int:
    """The rank that wrote a file of a torch-dcp checkpoint (.metadata, train_state.pt: 0)."""
    from runner.checkpoint.formats.dcp import rank_of_file

    return rank_of_file(path) or 0


def _rank_bytes(manifest: Any) -> dict[int, int]:
    written: dict[int, int] = {}
    for entry in manifest.files:
        written[_owner(entry.path)] = written.get(_owner(entry.path), 0) + entry.size
    return dict(sorted(written.items()))


def save_worker(args: argparse.Namespace) -> Results:
    """Every rank: the same state committed `--saves` times by write_ranked (a world of one
    runs the same code, Group of one rank); a world of one also times torch.save + fsync of
    the same state in the same process, before or after each save (alternating by round)."""
    from runner.checkpoint.writer import CheckpointWriter
    from runner.collective import dedicated_group

    group = dedicated_group(timeout_s=600)
    state = _replicated_state(args.save_mb, group.world_size)
    fingerprint = state.fingerprint()
    root = _shared_dir(group, args.scratch)
    writer = CheckpointWriter(root / "checkpoints", run_id="bench", writer_id="bench")
    saves: list[float] = []
    plain: list[float] = []
    try:
        for i in range(args.saves):
            plain_first = (i + args.round) % 2 == 0
            if group.single and plain_first:
                plain.append(_torch_save_fsync(state, root))
            seconds, committed = _timed_commit(state, writer, group, fingerprint)
            saves.append(seconds)
            if group.single and not plain_first:
                plain.append(_torch_save_fsync(state, root))
            group.barrier()
            if group.rank == 0:  # the same step again next time, into an empty dir
                shutil.rmtree(committed.path)
    finally:
        group.barrier()
        if group.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "world_size": group.world_size,
        "state_bytes": _tensor_bytes(state),
        "checkpoint_bytes": committed.manifest.total_bytes,
        "files": len(committed.manifest.files),
        "rank_bytes": _rank_bytes(committed.manifest),
        "seconds": saves,
        "torch_save_seconds": plain,
    }


def save_run(name: str, args: argparse.Namespace, options: list[str]) -> dict[int, Results]:
    """Rounds of one launch per world size, the order reversed every other round; each world
    size's launches gathered under "rounds"."""
    worlds = [int(n) for n in args.save_ranks.split(",")]
    merged: dict[int, Results] = {n: {"world_size": n, "rounds": []} for n in worlds}
    for r in range(args.rounds):
        for n in worlds if r % 2 == 0 else worlds[::-1]:
            merged[n]["rounds"].append(launch(name, n, [*options, "--round", str(r)]))
    return merged


def _ratios(bests: float, per_round: list[float]) -> str:
    """A ratio of the best figures, and the same ratio round by round."""
    low, high = min(per_round), max(per_round)
    return (
        f"{bests:.2f}x best/best, {statistics.median(per_round):.2f}x median of "
        f"{len(per_round)} rounds ({low:.2f}-{high:.2f})"
    )


def save_report(by_world: dict[int, Results]) -> list[str]:
    first = next(iter(by_world.values()))["rounds"][0]
    lines = [
        f"save: one checkpoint of the same replicated state ({first['state_bytes'] / MB:.0f} MB of "
        f"fp32 params + AdamW m, v; {first['checkpoint_bytes'] / MB:.0f} MB on disk), "
        "write_ranked (DCP, sha256 while writing, fsync, manifest) at each world size vs "
        "torch.save + fsync; seconds, rank 0's clock, barrier to committed",
        f"{'how':<22}{'ranks':>6}{'best s':>9}{'median s':>10}{'MB/s':>8}"
        f"{'rounds x saves':>16}  MB written per rank",
    ]
    best: dict[int, list[float]] = {}
    for world, res in sorted(by_world.items()):
        best[world] = [min(r["seconds"]) for r in res["rounds"]]
        every = [s for r in res["rounds"] for s in r["seconds"]]
        per_rank = ", ".join(
            f"{rank}: {size / MB:.0f}" for rank, size in res["rounds"][0]["rank_bytes"].items()
        )
        lines.append(_save_row("write_ranked", world, every, first, len(res["rounds"]), per_rank))
    plain = [s for r in by_world.get(1, {"rounds": []})["rounds"] for s in r["torch_save_seconds"]]
    if plain:
        lines.append(_save_row("torch.save + fsync", 1, plain, first, len(best[1]), "0: all"))
    for world in sorted(best):
        if world != 1 and 1 in best:
            ratios = [a / b for a, b in zip(best[world], best[1], strict=True)]
            both = _ratios(min(best[world]) / min(best[1]), ratios)
            lines.append(f"save: {world} ranks / 1 rank (seconds; same round): {both}")
    if plain:
        ratios = [min(r["seconds"]) / min(r["torch_save_seconds"]) for r in by_world[1]["rounds"]]
        both = _ratios(min(best[1]) / min(plain), ratios)
        lines.append(
            f"save: 1 rank write_ranked / torch.save + fsync (seconds; same launch): {both}"
        )
    return lines


def _save_row(
    how: str, world: int, seconds: list[float], first: Results, rounds: int, per_rank: str
) -> str:
    saves = len(seconds) // rounds
    rate = first["checkpoint_bytes"] / MB / min(seconds)
    return (
        f"{how:<22}{world:>6}{min(seconds):>9.2f}{statistics.median(seconds):>10.2f}"
        f"{rate:>8.0f}{f'{rounds} x {saves}':>16}  {per_rank}"
    )


UPLOAD_MODES = ("every rank", "one uploader, pool", "one uploader, serial")


def _every_rank_upload(storage: Any, committed: Any, group: Any) -> None:
    """Each rank puts its own files (size checked by HEAD, sha256 by the server where it can),
    then rank 0 the manifest, create-only, once every rank is done: the mirror's layout."""
    from runner.checkpoint.layout import checkpoint_key, manifest_key
    from runner.errors import StorageTransientError
    from runner.mirror.remote_layout import new_attempt_id, to_remote

    local = committed.manifest
    attempt = group.broadcast(new_attempt_id("bench") if group.rank == 0 else "")
    base = checkpoint_key(local.step)
    for entry in local.files:
        if _owner(entry.path) == group.rank:
            key = f"{base}/{attempt}/{entry.path}"
            storage.put_file(key, committed.path / entry.path, sha256=entry.sha256)
            if storage.head(key).size != entry.size:
                raise StorageTransientError(f"{key}: stored size differs from {entry.size}")
    group.barrier()
    if group.rank == 0:
        remote = to_remote(local, attempt=attempt)
        storage.put_bytes(manifest_key(local.step), remote.to_json(), if_absent=True)


def upload_worker(args: argparse.Namespace) -> Results:
    """Every rank: one committed checkpoint of the replicated state, then rounds of its upload
    three ways, the order rotated every round, each to a fresh prefix (removed after): every
    rank its own files; rank 0 alone by the mirror's upload (its per-file pool); rank 0
    alone, one file at a time; after one untimed upload (a fresh server makes its volumes).
    Rank 0 verifies the first every-rank copy (untimed). Long because it is the section's
    whole measurement, in order."""
    from runner.checkpoint.verify import verify_checkpoint
    from runner.checkpoint.writer import CheckpointWriter
    from runner.collective import dedicated_group
    from runner.mirror.upload import upload_checkpoint
    from runner.storage import open_storage

    group = dedicated_group(timeout_s=600)
    state = _replicated_state(args.save_mb, group.world_size)
    root = _shared_dir(group, args.scratch)
    writer = CheckpointWriter(root / "checkpoints", run_id="bench", writer_id="bench")
    _, committed = _timed_commit(state, writer, group, state.fingerprint())
    alone = group.rank == 0
    modes: dict[str, Callable[[Any], object]] = {
        UPLOAD_MODES[0]: lambda s: _every_rank_upload(s, committed, group),
        UPLOAD_MODES[1]: lambda s: alone and upload_checkpoint(s, committed.path),
        UPLOAD_MODES[2]: lambda s: alone and upload_checkpoint(s, committed.path, file_workers=1),
    }
    seconds: dict[str, list[float]] = {name: [] for name in modes}
    verified = ""
    try:
        warmup = open_storage(f"{args.storage_uri}/warmup")  # a fresh server makes volumes
        _every_rank_upload(warmup, committed, group)
        if alone:
            for info in list(warmup.list("")):
                warmup.delete(info.key)
        for r in range(args.rounds):
            for k in range(len(UPLOAD_MODES)):
                name = UPLOAD_MODES[(k + r) % len(UPLOAD_MODES)]
                storage = open_storage(f"{args.storage_uri}/round{r}-{k}")
                group.barrier()
                start = time.perf_counter()
                modes[name](storage)
                group.barrier()
                seconds[name].append(time.perf_counter() - start)
                if alone and name == UPLOAD_MODES[0] and not verified:
                    verified = verify_checkpoint(storage, committed.step).fingerprint
                if alone:
                    for info in list(storage.list("")):
                        storage.delete(info.key)
    finally:
        group.barrier()
        if alone:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "world_size": group.world_size,
        "checkpoint_bytes": committed.manifest.total_bytes,
        "files": len(committed.manifest.files),
        "rank_bytes": _rank_bytes(committed.manifest),
        "seconds": seconds,
        "every_rank_copy_verifies": verified == committed.manifest.fingerprint,
    }


def upload_run(name: str, args: argparse.Namespace, options: list[str]) -> dict[int, Results]:
    """The S3 store of BENCH_S3_ENDPOINT or a SeaweedFS of its own (a file:// bucket when it
    cannot start), one launch of --upload-ranks ranks."""
    from tests.fixtures.s3 import bench_s3

    scratch = Path(tempfile.mkdtemp(prefix="bench-upload-", dir=args.dir))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        try:
            server = stack.enter_context(bench_s3(scratch / "seaweedfs"))
            env = server.env()
            uri = f"s3://{server.create_bucket()}/bench"
            target = f"S3 at {server.endpoint}"
        except RuntimeError as exc:
            print(
                f"upload: SeaweedFS did not start ({exc}); using a file:// bucket", file=sys.stderr
            )
            env, uri = {}, f"file://{scratch / 'bucket'}"
            target = "a file:// bucket on the local disk: SeaweedFS did not start"
        res = launch(name, args.upload_ranks, [*options, "--storage-uri", uri], env=env)
        return {args.upload_ranks: {**res, "target": target}}


def upload_report(by_world: dict[int, Results]) -> list[str]:
    lines = []
    for world, res in sorted(by_world.items()):
        size = res["checkpoint_bytes"] / MB
        per_rank = ", ".join(f"{rank}: {b / MB:.0f}" for rank, b in res["rank_bytes"].items())
        lines += [
            f"upload: the {res['files']} files of one committed {world}-rank checkpoint "
            f"({size:.0f} MB; MB per rank {per_rank}) to {res['target']}",
            f"{'how':<24}{'best s':>9}{'median s':>10}{'MB/s':>8}{'rounds':>8}",
        ]
        times = res["seconds"]
        for name in UPLOAD_MODES:
            best = min(times[name])
            lines.append(
                f"{name:<24}{best:>9.2f}{statistics.median(times[name]):>10.2f}"
                f"{size / best:>8.0f}{len(times[name]):>8}"
            )
        for name in UPLOAD_MODES[1:]:
            ratios = [b / a for a, b in zip(times[UPLOAD_MODES[0]], times[name], strict=True)]
            both = _ratios(min(times[name]) / min(times[UPLOAD_MODES[0]]), ratios)
            lines.append(f"upload: every rank / {name} (MB/s; same round): {both}")
        verifies = "verifies" if res["every_rank_copy_verifies"] else "DOES NOT VERIFY"
        lines.append(f"the every-rank copy {verifies} (runner.checkpoint.verify, streamed)")
    return lines


SECTIONS = {
    "agreement": Section("agreement", agreement_worker, agreement_report),
    "save": Section("save", save_worker, save_report, save_run),
    "upload": Section("upload", upload_worker, upload_report, upload_run),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--iterations", type=int, default=2000, help="per mechanism, alone")
    parser.add_argument("--loop-steps", type=int, default=60, help="training steps per block")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument(
        "--save-mb",
        type=float,
        default=128,
        help="MB of fp32 parameters (save, upload; the checkpoint holds 3x: AdamW m and v)",
    )
    parser.add_argument("--save-ranks", default="1,2", help="save: world sizes (1,2,4: ~2x longer)")
    parser.add_argument("--upload-ranks", type=int, default=2, help="upload: world size")
    parser.add_argument("--rounds", type=int, default=3, help="save, upload: interleaved rounds")
    parser.add_argument("--saves", type=int, default=2, help="save: checkpoints per launch")
    parser.add_argument("--dir", default=None, help="save, upload: scratch space (default /tmp)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--storage-uri", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args)
        return
    options = [
        "--iterations", str(args.iterations), "--loop-steps", str(args.loop_steps),
        "--warmup-steps", str(args.warmup_steps), "--save-mb", str(args.save_mb),
        "--saves", str(args.saves), "--rounds", str(args.rounds),
    ]  # fmt: skip
    results: dict[str, dict[int, Results]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-distributed-", dir=args.dir) as scratch:
        options += ["--scratch", scratch]
        for name in args.sections.split(","):
            section = SECTIONS[name]
            if section.run is not None:
                results[name] = section.run(name, args, options)
            else:
                worlds = map(int, args.ranks.split(","))
                results[name] = {n: launch(name, n, options) for n in worlds}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, by_world in results.items():
        print("\n".join(SECTIONS[name].report(by_world)))


if __name__ == "__main__":
    main()
