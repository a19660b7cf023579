"""Ranks given settings that must be equal on all of them refuse to start, under real torchrun.

- test_ranks_of_one_node_given_their_own_run_dirs_all_exit_2: one node, 2 ranks, a wrapper
  that appends $LOCAL_RANK to --run-dir: every rank exits 2 before any checkpoint is read or
  written, naming both run dirs; neither dir holds a checkpoint.
- test_ranks_given_different_demo_settings_all_exit_2_at_once: one node, rank 0 given
  --parallel ddp --batch-size 4, rank 1 fsdp and 6: both exit 2 before DDP's and FSDP's
  set-up (collectives that differ between the two: they would wait for each other until
  --collective-timeout), naming both settings.
- test_nodes_given_different_steps_all_exit_2_at_once: two nodes (two torchrun trees, each
  its own run dir, which nodes may) against a real SeaweedFS bucket, given different --steps:
  both exit 2 within seconds of starting, not after --collective-timeout, naming both values;
  the bucket holds nothing.
"""

from __future__ import annotations

import re
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures.multinode import Node, wait_all
from tests.fixtures.multirank import demo_args
from tests.fixtures.s3 import SeaweedS3
from tests.fixtures.torchrun import Torchrun

pytestmark = pytest.mark.e2e

# torchrun's failure summary: "rank      : R (local_rank: L)" then "exitcode  : C (pid: P)"
_FAILED = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)")
_ERROR = "runner: error: the ranks of this job were not given the same settings:"
_ADVICE = "give every rank the same options"


def failed_exits(agent_log: str) -> dict[int, int]:
    """rank -> exit code, as torchrun's failure summary reports each failed worker."""
    return {int(rank): int(code) for rank, code in _FAILED.findall(agent_log)}


def differing(stderr: str) -> list[str]:
    """The lines of the settings refusal that name a differing setting."""
    return [line.strip() for line in stderr.splitlines() if " differs between " in line]


def test_ranks_of_one_node_given_their_own_run_dirs_all_exit_2(
    torchrun: Callable[..., Torchrun], tmp_path: Path
) -> None:
    base = tmp_path / "base"
    # a wrapper as a user might write one: each rank a run dir of its own
    command = shlex.join([sys.executable, *demo_args(Path("@RUN_DIR@"), steps=4, ckpt_every=2)])
    script = "exec " + command.replace("@RUN_DIR@", f'{shlex.quote(str(base))}"$LOCAL_RANK"')
    launch = torchrun(2, ["sh", "-c", script], torchrun_args=["--no-python"])
    # the workers exit 2, which torchrun's agent counts as a failed launch: exit 1
    assert launch.wait(180) == 1, launch.output()
    assert failed_exits(launch.output()) == {0: 2, 1: 2}, launch.output()
    run_dirs = [Path(f"{base}{rank}").resolve() for rank in (0, 1)]
    for rank in (0, 1):
        stderr = launch.rank_stderr(rank)
        assert _ERROR in stderr and _ADVICE in stderr, stderr
        assert differing(stderr) == [
            f"--run-dir differs between the ranks of node 0: rank 0: {run_dirs[0]}, "
            f"rank 1: {run_dirs[1]}"
        ], stderr
        assert "Traceback" not in stderr, stderr
    for run_dir in run_dirs:
        assert not list(run_dir.rglob("manifest.json")), run_dir
        assert not (run_dir / "checkpoints").exists(), sorted(run_dir.rglob("*"))
        assert not (run_dir / "loss.jsonl").exists()


def test_ranks_given_different_demo_settings_all_exit_2_at_once(
    torchrun: Callable[..., Torchrun], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # the last --batch-size wins: each rank's own, after demo_args' common one
    args = demo_args(run_dir, "--parallel", "@P@", "--batch-size", "@B@", steps=4, ckpt_every=2)
    command = shlex.join([sys.executable, *args]).replace("@P@", '"$P"').replace("@B@", '"$B"')
    script = f'if [ "$LOCAL_RANK" = 0 ]; then P=ddp B=4; else P=fsdp B=6; fi; exec {command}'
    started = time.monotonic()
    launch = torchrun(2, ["sh", "-c", script], torchrun_args=["--no-python"])
    assert launch.wait(150) == 1, launch.output()
    took = time.monotonic() - started
    print(f"torchrun exited {took:.1f} s after it was started")
    assert took < 150, took  # --collective-timeout is 300 s: nobody waited for it
    assert failed_exits(launch.output()) == {0: 2, 1: 2}, launch.output()
    for rank in (0, 1):
        stderr = launch.rank_stderr(rank)
        assert _ERROR in stderr and _ADVICE in stderr, stderr
        assert differing(stderr) == [
            "--batch-size differs between ranks: rank 0: 4, rank 1: 6",
            "--parallel differs between ranks: rank 0: ddp, rank 1: fsdp",
        ], stderr
        assert "fully_shard" not in stderr, stderr  # refused before the model was sharded
    assert not (run_dir / "checkpoints").exists()


def bucket_keys(s3: SeaweedS3, bucket: str) -> list[str]:
    listed = s3.client().list_objects_v2(Bucket=bucket, Prefix="run/")
    return [item["Key"] for item in listed.get("Contents", [])]


def test_nodes_given_different_steps_all_exit_2_at_once(
    multinode: Callable[..., list[Node]],
    s3_server: SeaweedS3,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    mirror = f"s3://{s3_bucket}/run"
    timeout = 300  # the default --collective-timeout, said explicitly: the refusal is no wait

    def args_of(i: int) -> list[str]:
        return demo_args(
            tmp_path / f"node{i}", "--mirror", mirror, "--collective-timeout", str(timeout),
            steps=(8, 12)[i], ckpt_every=4,
        )  # fmt: skip

    started = time.monotonic()
    nodes = multinode(args_of, env=s3_server.env())
    # each agent reports its worker's non-zero exit as its own failure
    assert wait_all(nodes, 150) == [1, 1], [node.output() for node in nodes]
    took = time.monotonic() - started
    print(f"both nodes exited {took:.1f} s after they were started")
    assert took < timeout / 2, took
    assert [node.failed_exits() for node in nodes] == [{0: 2}, {1: 2}]
    for node in nodes:
        stderr = node.rank_stderr()
        assert _ERROR in stderr and _ADVICE in stderr, stderr
        # each node's own run dir is no difference: only --steps is named
        assert differing(stderr) == ["--steps differs between ranks: rank 0: 8, rank 1: 12"]
    assert bucket_keys(s3_server, s3_bucket) == []
    for i in (0, 1):
        assert not (tmp_path / f"node{i}" / "checkpoints").exists(), i
