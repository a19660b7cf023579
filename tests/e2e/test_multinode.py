"""A job on two "nodes": two plain torchrun trees on this machine, one rank each,
each with its own run dir, sharing only the mirror, a real SeaweedFS bucket.

- test_stop_on_one_node_then_one_node_alone_resumes: SIGTERM to node 1's worker once the
  bucket holds a checkpoint stops both ranks after the same step, each exits 75; the final
  checkpoint is committed in the bucket only (world_size 2, every rank's files, verifies; no
  run dir holds a step dir). One node alone then resumes it from the mirror with one rank
  (a plain `runner demo`, a fresh run dir): the step is rescaled x 2, the run ends at the
  samples_seen of an uninterrupted 2-rank run, and every sample of the epoch was consumed
  exactly once, in order, across both attempts (--sample-log).
- test_different_mirrors_are_refused_and_a_damaged_newest_checkpoint_is_healed: nodes with
  different --mirror locations exit 2; a damaged newest checkpoint in the bucket is refused on
  every rank, the one before resumed to the exact fingerprint, the step committed again.
- test_a_node_vanishing_fails_the_other_within_the_bound: node 1's whole tree SIGKILLed once
  a checkpoint is committed: node 0's worker exits 1 and its agent non-zero within
  --collective-timeout + 30 s; the bucket's newest checkpoint still verifies, world_size 2.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runner.atomicity.temp import is_temp_name
from runner.checkpoint.formats.dcp import DCP_METADATA, TRAIN_STATE_FILE, rank_file_name
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.manifest import FORMAT_DCP, Manifest
from runner.checkpoint.verify import verify_checkpoint
from runner.demo.components import build_demo
from runner.state.sampler import ResumableSampler
from runner.storage import open_storage
from tests.fixtures.demo_process import checkpoint_steps, manifest
from tests.fixtures.multinode import Node, wait_all
from tests.fixtures.multirank import (
    BATCH,
    EVERY,
    PEER_LOST_END,
    STEPS,
    Plain,
    Straight,
    demo_args,
    final_fingerprint,
    sample_lines,
    stops,
    wait_until,
)
from tests.fixtures.s3 import SeaweedS3

pytestmark = pytest.mark.e2e

COLLECTIVE_TIMEOUT_S = 30
_MANIFEST = re.compile(r"checkpoints/step_(\d+)/manifest\.json$")


@pytest.fixture(scope="module")
def order() -> list[int]:
    """Epoch 0's order of the demo dataset (the demo's seed 0, the tests' batch size)."""
    dataset = build_demo(seed=0, device="cpu", batch_size=BATCH, total_steps=STEPS).dataset
    return ResumableSampler(len(dataset), batch_size=BATCH, seed=0).epoch_order(0).tolist()


def bucket_steps(client: Any, bucket: str) -> list[int]:
    """Steps with a manifest in the bucket (read with a raw client, not the runner's)."""
    listed = client.list_objects_v2(Bucket=bucket, Prefix="run/checkpoints/")
    keys = [item["Key"] for item in listed.get("Contents", [])]
    return sorted(int(m[1]) for key in keys if (m := _MANIFEST.search(key)))


def start_two_nodes(
    multinode: Callable[..., list[Node]], s3: SeaweedS3, tmp_path: Path, mirror: str, *extra: str
) -> list[Node]:
    """Two nodes of one rank each, node i on run dir tmp_path/node<i>, logging its samples
    to tmp_path/node<i>-samples.jsonl.rank<i>."""

    def args_of(i: int) -> list[str]:
        samples = tmp_path / f"node{i}-samples.jsonl"
        return demo_args(
            tmp_path / f"node{i}", "--mirror", mirror, "--sample-log", str(samples), *extra
        )

    nodes = multinode(args_of, env=s3.env())
    for i, node in enumerate(nodes):
        assert list(node.worker_pids()) == [i]
    return nodes


def wait_for_commit(nodes: list[Node], s3: SeaweedS3, bucket: str) -> None:
    client = s3.client()
    wait_until(
        lambda: bool(bucket_steps(client, bucket)),
        lambda: all(node.agent.poll() is None for node in nodes),
        "checkpoint committed in the bucket",
    )


def newest_in(mirror: str) -> Manifest:
    """The mirror's newest checkpoint, verified (every file's sha256, the counters)."""
    storage = open_storage(mirror)
    return verify_checkpoint(storage, list_checkpoints(storage)[-1])


def no_step_dirs(tmp_path: Path, *, killed: int | None = None) -> None:
    """No node keeps a step dir: its checkpoints are in the bucket. A node SIGKILLed while
    it staged its part may leave that staging dir (`.tmp-`, swept at its next start)."""
    for i in (0, 1):
        left = sorted(p.name for p in (tmp_path / f"node{i}" / "checkpoints").iterdir())
        if i == killed:
            left = [name for name in left if not is_temp_name(name)]
        assert left == [], i


def test_stop_on_one_node_then_one_node_alone_resumes(
    multinode: Callable[..., list[Node]],
    plain_demo: Callable[..., Plain],
    s3_server: SeaweedS3,
    s3_bucket: str,
    tmp_path: Path,
    order: list[int],
    straight_2rank: Straight,
) -> None:
    mirror = f"s3://{s3_bucket}/run"
    nodes = start_two_nodes(multinode, s3_server, tmp_path, mirror)
    wait_for_commit(nodes, s3_server, s3_bucket)
    os.kill(nodes[1].worker_pids()[1], signal.SIGTERM)
    # each agent reports its worker's non-zero exit as its own failure
    assert wait_all(nodes, 90) == [1, 1], [node.output() for node in nodes]
    assert [node.exits() for node in nodes] == [{0: 75}, {1: 75}]
    assert [node.failed_exits() for node in nodes] == [{0: 75}, {1: 75}]

    final = newest_in(mirror)
    stopped = final.step
    assert (final.world_size, final.format) == (2, FORMAT_DCP)
    assert final.samples_seen == stopped * 2 * BATCH
    attempt = final.extra["mirror_attempt"]
    names = [DCP_METADATA, TRAIN_STATE_FILE, "__0_0.distcp", "__1_0.distcp"]
    names += [rank_file_name(0), rank_file_name(1)]
    assert sorted(f.path for f in final.files) == sorted(f"{attempt}/{n}" for n in names)
    assert stops(nodes[1].rank_stderr()) == [("SIGTERM", stopped)], nodes[1].rank_stderr()
    assert stops(nodes[0].rank_stderr()) == [("stop requested on another rank", stopped)]
    no_step_dirs(tmp_path)
    # both ranks trained steps 1..stopped, no more
    lines = [sample_lines(tmp_path / f"node{i}-samples.jsonl.rank{i}") for i in (0, 1)]
    for rank, mine in enumerate(lines):
        assert [(line["step"], line["rank"]) for line in mine] == [
            (step, rank) for step in range(1, stopped + 1)
        ]

    alone, samples = tmp_path / "alone", tmp_path / "alone-samples.jsonl"
    again = plain_demo(alone, "--mirror", mirror, "--sample-log", str(samples))
    assert again.wait(180) == 0, again.output()
    out = again.output()
    assert f"resuming from step {stopped}, downloaded from {mirror}" in out, out
    assert f"world size changed 2 -> 1: step rescaled {stopped} -> {2 * stopped} " in out
    end = 2 * STEPS
    last = manifest(alone, end)
    assert (last["world_size"], last["step"]) == (1, end)
    assert last["samples_seen"] == straight_2rank.manifest["samples_seen"] == 480
    assert checkpoint_steps(alone)[-1] == end

    # epoch 0's order, sample by sample: 2 ranks' slices of each global batch, then 1 rank's
    resumed = sample_lines(samples)
    assert [line["step"] for line in resumed] == list(range(2 * stopped + 1, end + 1))
    batches = [line for step in zip(*lines, strict=True) for line in step] + resumed
    consumed = [int(i) for line in batches for i in line["indices"]]
    assert all(line["epoch"] == 0 for line in [*lines[0], *lines[1], *resumed])
    assert consumed == order[:480]


def test_a_node_vanishing_fails_the_other_within_the_bound(
    multinode: Callable[..., list[Node]],
    s3_server: SeaweedS3,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    mirror = f"s3://{s3_bucket}/run"
    timeout = ("--collective-timeout", str(COLLECTIVE_TIMEOUT_S))
    nodes = start_two_nodes(multinode, s3_server, tmp_path, mirror, *timeout)
    wait_for_commit(nodes, s3_server, s3_bucket)
    nodes[1].kill_tree()
    killed = time.monotonic()
    code = nodes[0].wait(COLLECTIVE_TIMEOUT_S + 30)
    took = time.monotonic() - killed
    print(f"node 0's agent exited {code} {took:.1f} s after node 1 was SIGKILLed")
    assert code != 0, nodes[0].output()
    assert nodes[0].failed_exits() == {0: 1}, nodes[0].output()
    # its next collective with the dead rank failed at once, said so plainly and exited
    survivor = nodes[0].rank_stderr()
    # (in the training step's all-reduce, or in a commit's collective if it was committing)
    lost = [line for line in survivor.splitlines() if line.startswith("runner: error: ")]
    assert len(lost) == 1, survivor
    assert lost[0].startswith("runner: error: rank 0 of 2: a collective "), survivor
    assert lost[0].endswith(PEER_LOST_END), survivor
    assert "Traceback" not in survivor, survivor

    final = newest_in(mirror)
    assert final.world_size == 2 and final.step in bucket_steps(s3_server.client(), s3_bucket)
    no_step_dirs(tmp_path, killed=1)


def test_different_mirrors_are_refused_and_a_damaged_newest_checkpoint_is_healed(
    multinode: Callable[..., list[Node]],
    s3_server: SeaweedS3,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    """Nodes given different --mirror locations all exit 2 before training, naming both.
    A finished 2-node run's newest checkpoint damaged in the bucket (one byte of rank 1's
    data file, same size: only hashing sees it): two fresh nodes refuse it on every rank,
    resume from the one before, end at the first run's exact fingerprint, and the step is
    committed again in place of the damaged copy (which is kept aside)."""
    mirror = f"s3://{s3_bucket}/run"

    def node_args(base: Path, mirror_of: Callable[[int], str]) -> Callable[[int], list[str]]:
        return lambda i: demo_args(base / f"node{i}", "--mirror", mirror_of(i))

    split = multinode(node_args(tmp_path / "split", lambda i: f"{mirror}{i}"), env=s3_server.env())
    assert wait_all(split, 90) == [1, 1]
    assert [node.failed_exits() for node in split] == [{0: 2}, {1: 2}]
    for node in split:
        assert (
            f"\n  --mirror differs between ranks: rank 0: {mirror}0, rank 1: {mirror}1\n"
        ) in node.rank_stderr(), node.rank_stderr()
    assert bucket_steps(s3_server.client(), s3_bucket) == []

    first = multinode(node_args(tmp_path / "first", lambda _: mirror), env=s3_server.env())
    assert wait_all(first, 120) == [0, 0], [node.output() for node in first]
    done, fingerprint = final_fingerprint(first[0].rank_stderr())
    assert done == STEPS
    steps = bucket_steps(s3_server.client(), s3_bucket)
    assert steps[-2:] == [STEPS - EVERY, STEPS], steps
    newest = newest_in(mirror)
    damaged = f"run/checkpoints/step_{STEPS:06d}/{newest.extra['mirror_attempt']}/__1_0.distcp"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=s3_bucket, Key=damaged)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=damaged, Body=bytes(data))

    again = multinode(node_args(tmp_path / "again", lambda _: mirror), env=s3_server.env())
    assert wait_all(again, 120) == [0, 0], [node.output() for node in again]
    log0 = again[0].rank_stderr()
    assert f"not resuming from step {STEPS}: " in log0, log0
    assert "__1_0.distcp: sha256 differs from the manifest" in log0, log0
    resumed = (
        f"resumed from the mirror (each rank fetched the files it reads) (step {STEPS - EVERY},"
    )
    assert resumed in log0, log0
    assert final_fingerprint(again[0].rank_stderr()) == (STEPS, fingerprint)
    healed = newest_in(mirror)  # verified: every file hashed
    assert healed.step == STEPS and healed.fingerprint == fingerprint
    assert healed.extra["mirror_attempt"] != newest.extra["mirror_attempt"]
    aside = client.list_objects_v2(Bucket=s3_bucket, Prefix="run/aside/").get("Contents", [])
    assert any(f"step_{STEPS:06d}-" in item["Key"] for item in aside), aside
