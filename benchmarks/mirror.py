"""Mirror throughput against boto3's defaults, side by side in one run, on a local SeaweedFS.

A committed checkpoint of one payload file (default 1440 MB, the seeds' ANDREA-120M with m and
v; random bytes, so nothing compresses) is moved four ways:

  upload    runner   upload_checkpoint: sha256 + part digests in one read, multipart upload
                     with per-part SHA-256, HEAD with size and composite-checksum check,
                     manifest last (create-only)
            boto3    client.upload_file with the default TransferConfig (no verification)
  download  runner   download_checkpoint: concurrent ranged GETs, fsync, sha256 of every file,
                     manifest last, directory rename
            boto3    client.download_file with the default TransferConfig (no verification)
            boto3+   the same, then fsync and a sha256 pass: the runner's guarantees done naively

Then the time to make a final checkpoint durable: `Mirror.upload_now` of the same checkpoint
(each round), the same on --nodes processes at once, each with a checkpoint of its own (the
final uploads of several nodes to one bucket; here they share the machine's cores with each
other and with the store), and, when `runner demo` exists, SIGTERM to exit of a demo run with
`--mirror` (exit 75 only after the final checkpoint is in the bucket).

Usage: python benchmarks/mirror.py [--size-mb 1440] [--repeat 1] [--nodes 2] [--dir PATH]
Ratios > 1 mean the runner is faster than boto3's default (throughput ratio); times are the
median of the rounds with their range.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the SeaweedFS helper lives with the test fixtures

from runner.atomicity.files import sha256_file  # noqa: E402
from runner.checkpoint.manifest import FORMAT_SEED_BIN  # noqa: E402
from runner.checkpoint.writer import (  # noqa: E402
    CheckpointMeta,
    CheckpointWriter,
    CommittedCheckpoint,
)
from runner.mirror import Mirror, download_checkpoint, upload_checkpoint  # noqa: E402
from runner.storage.s3 import S3Storage  # noqa: E402
from tests.fixtures.s3 import SeaweedS3, bench_s3  # noqa: E402

MB = 1_000_000


def make_checkpoint(run_dir: Path, size: int) -> CommittedCheckpoint:
    run_dir.mkdir(parents=True, exist_ok=True)
    src = run_dir / "payload.bin"
    digest = hashlib.sha256()
    with open(src, "wb") as f:
        remaining = size
        while remaining:
            chunk = os.urandom(min(remaining, 16 * 1024 * 1024))
            f.write(chunk)
            digest.update(chunk)
            remaining -= len(chunk)
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="bench", writer_id="bench")
    meta = CheckpointMeta(
        step=100,
        samples_seen=3200,
        world_size=1,
        epoch=0,
        batch_in_epoch=100,
        fingerprint=digest.hexdigest(),
    )
    return writer.adopt_files({"state.bin": src}, meta=meta, format=FORMAT_SEED_BIN)


def boto3_verified_download(client: object, bucket: str, key: str, dst: Path) -> None:
    client.download_file(bucket, key, str(dst))  # type: ignore[attr-defined]
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())
    sha256_file(dst)


def clear_checkpoints(storage: S3Storage) -> None:
    """Remove every step from the bench's bucket prefix, so the next upload finds it free."""
    for info in list(storage.list("checkpoints/")):
        storage.delete(info.key)


def spread(values: list[float]) -> str:
    """Median and range of a figure's rounds."""
    low, high = min(values), max(values)
    return f"{statistics.median(values):.2f}s ({low:.2f}-{high:.2f}, {len(values)} rounds)"


def final_upload(storage: S3Storage, ckpt: CommittedCheckpoint, writer_id: str) -> float:
    """Seconds for `Mirror.upload_now` of ckpt (a stop's final upload, under its deadline);
    the step is removed again afterwards so that the next round finds it free."""
    mirror = Mirror(storage, keep=2, writer_id=writer_id)
    started = time.perf_counter()
    landed = mirror.upload_now(ckpt, deadline=time.monotonic() + 600)
    elapsed = time.perf_counter() - started
    mirror.close()
    if not landed:
        raise SystemExit(f"{writer_id}: the final upload did not land")
    clear_checkpoints(storage)
    return elapsed


def node(index: int, uri: str, env: dict[str, str], workdir: str, size: int, start: object,
         results: object) -> None:  # fmt: skip
    """One node of the several-node figure: its own checkpoint, then its final upload once
    every node is ready (start: a multiprocessing Barrier; results: a Queue)."""
    os.environ.update(env)
    ckpt = make_checkpoint(Path(workdir) / f"node{index}", size)
    storage = S3Storage.from_uri(f"{uri}/node{index}")
    start.wait()  # type: ignore[attr-defined]
    results.put(final_upload(storage, ckpt, f"node-{index}"))  # type: ignore[attr-defined]


def nodes_at_once(count: int, uri: str, env: dict[str, str], workdir: Path, size: int) -> float:
    """Seconds until the last of `count` nodes' final uploads has landed (all started at once)."""
    spawn = multiprocessing.get_context("spawn")
    start, results = spawn.Barrier(count), spawn.Queue()
    procs = [
        spawn.Process(target=node, args=(i, uri, env, str(workdir), size, start, results))
        for i in range(count)
    ]
    for proc in procs:
        proc.start()
    times: list[float] = []
    try:
        while len(times) < count:
            if any(proc.exitcode not in (None, 0) for proc in procs):
                raise SystemExit(f"a node of the {count}-node upload failed")
            with contextlib.suppress(queue.Empty):
                times.append(results.get(timeout=1.0))
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return max(times)


def timed(func: Callable[[], object]) -> float:
    started = time.perf_counter()
    func()
    return time.perf_counter() - started


def demo_sigterm_to_durable(server: SeaweedS3, workdir: Path) -> float | None:
    """Seconds from SIGTERM to the exit of `runner demo --mirror` (None without a demo)."""
    bucket = server.create_bucket()
    run_dir = workdir / "demo-run"
    cmd = [
        sys.executable, "-m", "runner", "demo", "--run-dir", str(run_dir), "--steps", "100000",
        "--ckpt-every", "25", "--device", "cpu", "--no-progress",
        "--mirror", f"s3://{bucket}/demo",
    ]  # fmt: skip
    env = {**os.environ, **server.env()}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "checkpoints" / "step_000025").is_dir():
            break
        time.sleep(0.1)
    if proc.poll() is not None:
        output = proc.stdout.read().decode() if proc.stdout else ""
        print(f"demo exited early ({proc.returncode}); skipping the SIGTERM figure:\n{output}")
        return None
    time.sleep(1.0)
    started = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0].decode()
    elapsed = time.perf_counter() - started
    durable = re.search(r"durable in local \+ mirror", output)
    if proc.returncode != 75 or not durable:
        print(f"demo did not report a durable final checkpoint (exit {proc.returncode})")
        return None
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=1440)
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every figure")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of the several-node upload")
    parser.add_argument("--dir", type=Path, default=None, help="scratch space (default: /tmp)")
    args = parser.parse_args()
    size = args.size_mb * MB

    workdir = Path(tempfile.mkdtemp(prefix="mirror-bench-", dir=args.dir))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        server = stack.enter_context(bench_s3(workdir / "seaweedfs"))
        os.environ.update(server.env())  # the runner reads the standard AWS chain
        bucket = server.create_bucket()
        storage = S3Storage.from_uri(f"s3://{bucket}/runner")
        client = server.client()
        ckpt = make_checkpoint(workdir / "run", size)
        step_dir = ckpt.path
        payload = step_dir / "state.bin"
        print(f"checkpoint: {size / MB:.0f} MB, S3 at {server.endpoint}")
        print(f"runner settings: {storage.settings}")

        results: dict[str, list[float]] = {
            k: [] for k in ("up_b", "up_r", "down_b", "down_bv", "down_r")
        }
        for i in range(args.repeat):
            results["up_b"].append(
                timed(lambda i=i: client.upload_file(str(payload), bucket, f"boto3/{i}/state.bin"))
            )
            results["up_r"].append(
                timed(lambda i=i: upload_checkpoint(storage, step_dir, writer_id=f"bench-{i}"))
            )
            target = workdir / f"down-{i}"
            target.mkdir()
            results["down_b"].append(
                timed(
                    lambda i=i, t=target: client.download_file(
                        bucket, f"boto3/{i}/state.bin", str(t / "state.bin")
                    )
                )
            )
            results["down_bv"].append(
                timed(
                    lambda i=i, t=target: boto3_verified_download(
                        client, bucket, f"boto3/{i}/state.bin", t / "verified.bin"
                    )
                )
            )
            results["down_r"].append(
                timed(lambda t=target: download_checkpoint(storage, 100, t / "run"))
            )
            shutil.rmtree(target)
            if i + 1 < args.repeat:  # the next upload must not find the step already there
                clear_checkpoints(storage)

        print(f"\n{'':24} {'best s':>8} {'MB/s':>8}  median and range")
        for label, key in (
            ("upload   boto3 default", "up_b"),
            ("upload   runner", "up_r"),
            ("download boto3 default", "down_b"),
            ("download boto3+fsync+sha", "down_bv"),
            ("download runner", "down_r"),
        ):
            best = min(results[key])
            print(f"{label:24} {best:8.2f} {size / MB / best:8.1f}  {spread(results[key])}")

        def ratio(baseline: str, runner: str) -> str:
            """Throughput ratio best/best, and the median of the rounds' ratios."""
            pairs = zip(results[baseline], results[runner], strict=True)
            rounds = statistics.median(b / r for b, r in pairs)
            return f"{min(results[baseline]) / min(results[runner]):.2f}x (median {rounds:.2f}x)"

        print(f"\nratio upload   runner / boto3 default: {ratio('up_b', 'up_r')} (runner also "
              "verifies)")  # fmt: skip
        print(f"ratio download runner / boto3 default: {ratio('down_b', 'down_r')} (runner "
              "also verifies)")  # fmt: skip
        print(f"ratio download runner / boto3 + fsync + sha256: {ratio('down_bv', 'down_r')} "
              "(same guarantees)")  # fmt: skip

        # the final checkpoint of a preempted run: a fresh step, uploaded before a deadline
        clear_checkpoints(storage)
        final = [final_upload(storage, ckpt, "bench-final") for _ in range(args.repeat)]
        print(f"\nfinal checkpoint upload_now: {spread(final)}")
        shutil.rmtree(workdir / "run")  # the nodes make their own
        several = [
            nodes_at_once(
                args.nodes, f"s3://{bucket}/nodes{r}", server.env(), workdir / f"nodes{r}", size
            )
            for r in range(args.repeat)
        ]
        print(
            f"final checkpoint upload_now, {args.nodes} nodes at once ({size / MB:.0f} MB "
            f"each), until the last landed: {spread(several)}"
        )
        demo = demo_sigterm_to_durable(server, workdir)
        if demo is not None:
            print(
                f"runner demo: SIGTERM to exit 75 with the final checkpoint in the bucket: "
                f"{demo:.2f}s"
            )


if __name__ == "__main__":
    main()
