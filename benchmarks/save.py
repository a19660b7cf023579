"""Checkpoint save/load throughput against the two baselines, side by side in one run.

A train state of N parameters (default 120M, the seeds' ANDREA-120M: weights + AdamW m and v,
~1.44 GB) is written three ways to the same directory:

  raw        the same tensor bytes written sequentially to one file, then fsync
  torch.save torch.save(state, path), then fsync
  runner     CheckpointWriter.write_state: stream + sha256 in the same pass, writeback
             started every 32 MiB, fsync, manifest, directory rename, directory fsyncs

plus two ablations of the early writeback: the runner without it (every byte left dirty until
the final fsync, as a plain write+fsync does) and the raw write with it. Then each is read back
three ways, each from a cold page cache for that file (posix_fadvise DONTNEED):

  raw        sequential read of the raw file into preallocated buffers
  torch.load torch.load(weights_only=True)
  runner     load_state: size + sha256 of every 64 MiB chunk (on every core), torch.load
             (weights_only=True) beside the hashing (its result used once every byte
             verified); again with mmap=True (tensors mapped from the file being hashed), and
             the ablations `serial` (the hashing first, then torch.load) and `whole` (the same
             payload under a manifest without chunk digests: one sha256 per file, one core)

plus verify_dir alone with and without the chunk digests, and the save without them.

Usage: python benchmarks/save.py [--params 120000000] [--repeat 1] [--dir PATH]
Ratios > 1 mean faster than the baseline (throughput ratio).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner.atomicity import files as atomic
from runner.checkpoint import staging
from runner.checkpoint.chunk_digests import CHUNK_FIELD
from runner.checkpoint.load import load_state
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter

DEFAULT_WRITEBACK_EVERY = atomic.WRITEBACK_EVERY
TENSOR_PARAMS = 8_000_000  # parameters per tensor: a 120M model is ~15 big matrices


def build_state(n_params: int) -> dict[str, Any]:
    sizes = [TENSOR_PARAMS] * (n_params // TENSOR_PARAMS)
    if n_params % TENSOR_PARAMS:
        sizes.append(n_params % TENSOR_PARAMS)
    gen = torch.Generator().manual_seed(0)
    model = {f"layer{i}.weight": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
    opt_state = {
        i: {
            "step": torch.tensor(100.0),
            "exp_avg": torch.randn(n, generator=gen),
            "exp_avg_sq": torch.rand(n, generator=gen),
        }
        for i, n in enumerate(sizes)
    }
    return {
        "schema": "2",
        "model": model,
        "param_names": list(model),
        "optimizer": {"state": opt_state, "param_groups": [{"params": list(range(len(sizes)))}]},
        "counters": {
            "step": 100,
            "epoch": 0,
            "batch_in_epoch": 100,
            "samples_seen": 3200,
            "world_size": 1,
        },
        "extra": {},
    }


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    out = list(state["model"].values())
    for entry in state["optimizer"]["state"].values():
        out += [entry["exp_avg"], entry["exp_avg_sq"]]
    return out


def drop_cache(path: Path) -> None:
    """Evict one file's pages so the next read comes from disk (affects only this file)."""
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def save_raw(state: dict[str, Any], path: Path, *, early_writeback: bool = False) -> None:
    with open(path, "wb", buffering=0) as f:
        written = flushed = 0
        for t in tensors_of(state):
            written += f.write(t.numpy().data.cast("B"))
            if early_writeback and written - flushed >= DEFAULT_WRITEBACK_EVERY:
                atomic.start_writeback(f.fileno(), flushed, written - flushed)
                flushed = written
        os.fsync(f.fileno())


def save_torch(state: dict[str, Any], path: Path) -> None:
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_runner(state: dict[str, Any], ckpt_dir: Path, *, early_writeback: bool = True) -> Path:
    # The ablation: every byte left dirty until the final fsync, as a plain write+fsync does.
    atomic.WRITEBACK_EVERY = DEFAULT_WRITEBACK_EVERY if early_writeback else 1 << 62
    writer = CheckpointWriter(ckpt_dir, run_id="bench", writer_id="bench")
    meta = CheckpointMeta(
        step=100, samples_seen=3200, world_size=1, epoch=0, batch_in_epoch=100, fingerprint="0" * 64
    )
    return writer.write_state(state, meta=meta).path


def save_runner_unchunked(state: dict[str, Any], ckpt_dir: Path) -> Path:
    """The ablation: no chunk digests, only the whole-file sha256 (what the writer did before)."""
    chunked_writer = staging.HashingFileWriter
    staging.HashingFileWriter = functools.partial(chunked_writer, chunked=False)  # type: ignore[assignment,misc]
    try:
        return save_runner(state, ckpt_dir)
    finally:
        staging.HashingFileWriter = chunked_writer  # type: ignore[misc]


def whole_file_copy(step_dir: Path, dest: Path) -> Path:
    """`step_dir` as a checkpoint written before chunk digests: the same payload (hard links)
    under a manifest without them, so it is verified by each file's sha256 alone."""
    copy = dest / step_dir.name
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    manifest = json.loads((step_dir / "manifest.json").read_bytes())
    manifest["extra"].pop(CHUNK_FIELD, None)
    for entry in manifest["files"]:
        (copy / entry["path"]).parent.mkdir(parents=True, exist_ok=True)
        os.link(step_dir / entry["path"], copy / entry["path"])
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def load_raw(path: Path, buffers: list[torch.Tensor]) -> None:
    with open(path, "rb", buffering=0) as f:
        for t in buffers:
            view = t.numpy().data.cast("B")
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise EOFError(path)
                got += n


def load_serial(step_dir: Path) -> dict[str, Any]:
    """The ablation: every byte hashed, then deserialised (a second pass, from the cache)."""
    return load_state(step_dir, manifest=verify_dir(step_dir, counters=False), verified=True)


def one_round(state: dict[str, Any], base: Path, *, rotate: int) -> dict[str, float]:
    """Each variant once on the same bytes; seconds per variant. The order rotates between
    rounds so that none always runs first (or right after another's writeback)."""
    raw, tsave, ckpts = base / "raw.bin", base / "torch.pt", base / "checkpoints"
    late, raw_early = base / "late" / "checkpoints", base / "raw-early.bin"
    unchunked = base / "unchunked" / "checkpoints"
    for p in (raw, raw_early, tsave):
        p.unlink(missing_ok=True)
    for d in (ckpts, late, unchunked):
        shutil.rmtree(d, ignore_errors=True)
    step_dir = ckpts / "step_000100"
    saves: list[tuple[str, Callable[[], object]]] = [
        ("save raw", lambda: save_raw(state, raw)),
        ("save raw early", lambda: save_raw(state, raw_early, early_writeback=True)),
        ("save torch", lambda: save_torch(state, tsave)),
        ("save runner", lambda: save_runner(state, ckpts)),
        ("save runner late", lambda: save_runner(state, late, early_writeback=False)),
        ("save runner whole", lambda: save_runner_unchunked(state, unchunked)),
    ]
    seconds: dict[str, float] = {}
    for i in range(len(saves)):
        name, fn = saves[(i + rotate) % len(saves)]
        gc.collect()
        start = time.perf_counter()
        fn()
        seconds[name] = time.perf_counter() - start
    whole = whole_file_copy(step_dir, base / "whole")
    buffers = [torch.empty_like(t) for t in tensors_of(state)]
    loads: list[tuple[str, Path, Callable[[], object]]] = [
        ("load raw", raw, lambda: load_raw(raw, buffers)),
        ("load torch", tsave, lambda: torch.load(tsave, weights_only=True, map_location="cpu")),
        ("load runner", step_dir, lambda: load_state(step_dir)),
        ("load runner mmap", step_dir, lambda: load_state(step_dir, mmap=True)),
        ("load runner serial", step_dir, lambda: load_serial(step_dir)),
        ("load runner whole", whole, lambda: load_state(whole)),
        ("load whole mmap", whole, lambda: load_state(whole, mmap=True)),
        ("verify runner", step_dir, lambda: verify_dir(step_dir)),
        ("verify whole", whole, lambda: verify_dir(whole)),
    ]
    for i in range(len(loads)):
        name, path, fn = loads[(i + rotate) % len(loads)]
        gc.collect()
        drop_cache(path)
        start = time.perf_counter()
        result = fn()
        seconds[name] = time.perf_counter() - start
        del result
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=120_000_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: cwd)")
    args = parser.parse_args()

    state = build_state(args.params)
    nbytes = sum(t.numel() * t.element_size() for t in tensors_of(state))
    print(f"state: {args.params:,} parameters, {nbytes / 1e9:.2f} GB of tensors (weights, m, v)")
    base = Path(tempfile.mkdtemp(prefix="bench-save-", dir=args.dir or Path.cwd()))
    results: dict[str, list[float]] = {}
    try:
        for round_no in range(args.repeat):
            for key, value in one_round(state, base, rotate=round_no).items():
                results.setdefault(key, []).append(value)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    best = {k: min(v) for k, v in results.items()}  # best of the rounds: least disturbed
    print(f"{'':19} {'seconds':>8} {'GB/s':>7}")
    for key, seconds in best.items():
        print(f"{key:19} {seconds:8.2f} {nbytes / seconds / 1e9:7.2f}")

    def ratio(baseline: str, ours: str) -> str:
        """Throughput ratio best vs best, then the median and range of the per-round ratios
        (one round = the same disk weather for both; a virtual disk's speed comes in bursts)."""
        rounds = sorted(b / o for b, o in zip(results[baseline], results[ours], strict=True))
        if len(rounds) == 1:
            return f"{rounds[0]:.2f}x"
        median = statistics.median(rounds)
        return (
            f"{best[baseline] / best[ours]:.2f}x best/best, per round median {median:.2f}x "
            f"({rounds[0]:.2f}-{rounds[-1]:.2f})"
        )

    print(f"save: runner / raw write + fsync          {ratio('save raw', 'save runner')}")
    print(f"save: runner / torch.save + fsync         {ratio('save torch', 'save runner')}")
    print(f"save: runner / raw write, early writeback {ratio('save raw early', 'save runner')}")
    print(f"save: runner, no early writeback / raw    {ratio('save raw', 'save runner late')}")
    print(f"save: runner / runner, no early writeback {ratio('save runner late', 'save runner')}")
    print(f"load: runner / raw read                   {ratio('load raw', 'load runner')}")
    print(f"load: runner / torch.load                 {ratio('load torch', 'load runner')}")
    print(f"load: runner mmap / torch.load            {ratio('load torch', 'load runner mmap')}")
    print(f"load: runner mmap / raw read              {ratio('load raw', 'load runner mmap')}")
    print(f"load: runner / runner, hashing first      {ratio('load runner serial', 'load runner')}")
    print(f"load: chunk digests / whole-file sha256   {ratio('load runner whole', 'load runner')}")
    mmap_ratio = ratio("load whole mmap", "load runner mmap")
    print(f"load mmap: chunk digests / whole-file     {mmap_ratio}")
    print(f"verify: chunk digests / whole-file sha256 {ratio('verify whole', 'verify runner')}")
    print(f"verify: chunk digests / raw read          {ratio('load raw', 'verify runner')}")
    print(f"save: chunk digests / whole-file only     {ratio('save runner whole', 'save runner')}")


if __name__ == "__main__":
    main()
