"""A whole resume from a bucket, to the first training step, against the plain baseline.

A model of N parameters with AdamW (default 120M: weights + m + v, ~1.44 GB, the seeds'
ANDREA-120M) trains one step, is checkpointed by a TrainSession and uploaded to a local
SeaweedFS. Then, in each round, side by side (the order alternates between rounds):

  plain   a new boto3 session's client (a resumed process has none), `download_file` of the
          checkpoint's state.pt (default TransferConfig) into an empty directory,
          `torch.load(weights_only=True)`, one training step
  runner  a TrainSession on an empty run dir with the bucket as its mirror: `restore()`
          (newest checkpoint found, downloaded, fsynced, every byte sha256-verified, counters
          checked, state loaded into the model and optimizer), one training step

Both end with the same step on the same model, so the ratio is the whole resume's price of
the runner's guarantees. `--profile` adds a cProfile of one more runner restore (the
functions with the most cumulative time), for where that price goes.

Usage: python benchmarks/resume.py [--params 120000000] [--rounds 3] [--profile] [--dir PATH]
Ratio > 1: the runner takes longer than the plain baseline (time ratio; the goal is <= 1.2).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the SeaweedFS helper lives with the test fixtures
sys.path.insert(0, str(REPO / "benchmarks"))

from stall import Bench  # noqa: E402

from runner.config import RunConfig  # noqa: E402
from runner.mirror import upload_checkpoint  # noqa: E402
from runner.runtime import lifecycle  # noqa: E402
from runner.session.train_session import TrainSession  # noqa: E402
from runner.storage.s3 import S3Storage  # noqa: E402
from tests.fixtures.s3 import SeaweedS3, bench_s3  # noqa: E402

PREFIX = "resume-bench"


def runner_resume(bench: Bench, run_dir: Path, mirror: str) -> float:
    """Seconds from a new TrainSession to the end of its first step after `restore()`."""
    started = time.perf_counter()
    session = TrainSession(
        RunConfig(run_dir=run_dir, mirror=mirror, ckpt_every=None, writer_id="bench-resume"),
        state=bench.state,
    )
    try:
        step = session.restore()
        if step is None:
            raise RuntimeError(f"the runner found no checkpoint in {mirror}")
        bench.step()
        session.step_done()
        return time.perf_counter() - started
    finally:
        session.close()  # no final checkpoint: not part of the resume


@contextlib.contextmanager
def profiled_worker(profile: cProfile.Profile) -> Iterator[None]:
    """Profile the worker thread that resolves the resume (runner.preemption.startup runs it
    off the session's thread, which only waits): cProfile sees the thread it is enabled in.
    The download's own transfer threads are not profiled; their time shows as waits."""
    original = lifecycle.run_interruptible

    def run(fn: Callable[[], Any], **kwargs: Any) -> Any:
        def inside() -> Any:
            profile.enable()
            try:
                return fn()
            finally:
                profile.disable()

        return original(inside, **kwargs)

    lifecycle.run_interruptible = run  # type: ignore[assignment]
    try:
        yield
    finally:
        lifecycle.run_interruptible = original  # type: ignore[assignment]


def plain_resume(bench: Bench, server: SeaweedS3, bucket: str, key: str, scratch: Path) -> float:
    """Seconds for a new boto3 session's client + download_file + torch.load + one step (no
    verification): the client is timed because a resumed process starts without one, as the
    runner's TrainSession does."""
    scratch.mkdir(parents=True)
    started = time.perf_counter()
    client = server.client()  # a new boto3 Session, as a new process has
    client.download_file(bucket, key, str(scratch / "state.pt"))
    state = torch.load(scratch / "state.pt", weights_only=True, map_location="cpu")
    bench.step()
    elapsed = time.perf_counter() - started
    del state
    return elapsed


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return f"median {statistics.median(ordered):.2f} s ({ordered[0]:.2f}-{ordered[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=120_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile one more restore")
    parser.add_argument("--dir", type=Path, default=None, help="scratch space (default: /tmp)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="resume-bench-", dir=args.dir))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        server = stack.enter_context(bench_s3(work / "seaweedfs"))
        os.environ.update(server.env())  # the runner reads the standard AWS chain
        bucket = server.create_bucket()
        mirror = f"s3://{bucket}/{PREFIX}"
        bench = Bench(args.params, batch=8)
        bench.step()
        source = TrainSession(
            RunConfig(run_dir=work / "source", ckpt_every=None, save_mode="sync"),
            state=bench.state,
        )
        source.restore()
        ckpt = source.save(reason="bench")
        source.close()
        upload_checkpoint(S3Storage.from_uri(mirror), ckpt.path, writer_id="bench-source")
        shutil.rmtree(work / "source")
        client = server.client()
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/checkpoints/")
        sizes = {o["Key"]: int(o["Size"]) for o in listed.get("Contents", [])}
        key = max(sizes, key=sizes.__getitem__)
        print(
            f"state: {bench.params:,} parameters, checkpoint {sizes[key] / 1e9:.2f} GB "
            f"({key.rsplit('/', 1)[-1]}), S3 at {server.endpoint}"
        )

        times: dict[str, list[float]] = {"plain": [], "runner": []}
        ratios: list[float] = []
        for round_no in range(args.rounds):
            one: dict[str, float] = {}
            for name in ("plain", "runner") if round_no % 2 == 0 else ("runner", "plain"):
                where = work / f"{name}-{round_no}"
                if name == "plain":
                    one[name] = plain_resume(bench, server, bucket, key, where)
                else:
                    one[name] = runner_resume(bench, where, mirror)
                shutil.rmtree(where, ignore_errors=True)
            for name, seconds in one.items():
                times[name].append(seconds)
            ratios.append(one["runner"] / one["plain"])
            print(
                f"round {round_no + 1}: plain {one['plain']:.2f} s, runner "
                f"{one['runner']:.2f} s, ratio {ratios[-1]:.2f}x"
            )
        print(f"plain  (download_file + torch.load + 1 step): {summary(times['plain'])}")
        print(f"runner (TrainSession.restore + 1 step):        {summary(times['runner'])}")
        print(
            f"resume from the bucket: runner / plain {statistics.median(ratios):.2f}x "
            f"(per round {min(ratios):.2f}-{max(ratios):.2f}; goal <= 1.2x)"
        )
        if args.profile:
            main_thread, worker = cProfile.Profile(), cProfile.Profile()
            main_thread.enable()
            with profiled_worker(worker):
                runner_resume(bench, work / "profiled", mirror)
            main_thread.disable()
            for name, profile in (("the session's thread", main_thread), ("its worker", worker)):
                out = io.StringIO()
                pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(25)
                print(f"\nprofile of one runner resume, {name} (cumulative):")
                print(out.getvalue())


if __name__ == "__main__":
    main()
