"""`runner run` on each node of a job on two nodes (two "nodes" on this machine: two
supervisors, each with its own run dir, a torchrun with `--nnodes 2` under each, static
rendezvous), one real SeaweedFS bucket shared. SIGTERM to node 1's supervisor (what Kubernetes
does to one pod) stops both ranks after the same step with one torch-dcp checkpoint of world
size 2 committed in the bucket by the ranks themselves; both supervisors exit 75 and neither
run dir holds a checkpoint. Two fresh nodes (empty run dirs) resume from the bucket alone and
end at the fingerprint of an uninterrupted 2-rank run on one node."""

from __future__ import annotations

import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_checkpoint
from runner.storage import Storage, open_storage
from tests.fixtures.multirank import final_fingerprint
from tests.fixtures.s3 import SeaweedS3
from tests.fixtures.supervised import Supervised
from tests.fixtures.torchrun import Torchrun, free_port

pytestmark = pytest.mark.e2e

# Finished by the resumed pair; long enough that the stop, sent once the first checkpoint is
# in the bucket, lands well before the end (25-100 ms a step on two CPU cores).
STEPS = 200
CKPT_EVERY = 4
DEMO = [
    "-m", "runner", "demo", "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY),
    "--batch-size", "4", "--device", "cpu", "--threads", "1", "--no-progress",
]  # fmt: skip
RANK_FILES = {
    ".metadata", "train_state.pt", "rank_00000.pt", "rank_00001.pt", "__0_0.distcp",
    "__1_0.distcp",
}  # fmt: skip
DURABLE = "final checkpoint durable in the mirror"


def _nodes(
    started: list[Supervised], tmp_path: Path, mirror: str, env: dict[str, str]
) -> list[Supervised]:
    """Node 0 and node 1 of one job, each `runner run` on its own run dir."""
    port = str(free_port())
    nodes = []
    for i in (0, 1):
        args = [
            "--run-dir", str(tmp_path / f"node{i}"), "--mirror", mirror, "--grace-seconds", "60",
            "--", sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--node-rank", str(i), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
            "--master-port", port, *DEMO,
        ]  # fmt: skip
        nodes.append(Supervised(args, env={**env, "OMP_NUM_THREADS": "1"}))
        started.append(nodes[-1])
    return nodes


def _wait_first_checkpoint(storage: Storage, nodes: list[Supervised]) -> int:
    end = time.monotonic() + 240
    while not (steps := list_checkpoints(storage)):
        for n in nodes:
            assert n.proc.poll() is None, f"exited {n.proc.returncode}:\n{n.err}"
        assert time.monotonic() < end, "no checkpoint in the bucket:\n" + nodes[0].err
        time.sleep(0.05)
    return steps[-1]


def _watch_bucket(storage: Storage, nodes: list[Supervised]) -> dict[int, float]:
    """Until every node exited: step -> when (monotonic) its manifest was first listed."""
    seen: dict[int, float] = {}
    end = time.monotonic() + 180
    while any(n.proc.poll() is None for n in nodes):
        assert time.monotonic() < end, "the nodes did not stop:\n" + nodes[1].err
        now = time.monotonic()
        for step in list_checkpoints(storage):
            seen.setdefault(step, now)
        time.sleep(0.02)
    for step in list_checkpoints(storage):
        seen.setdefault(step, time.monotonic())
    return seen


def _assert_no_local_checkpoint(tmp_path: Path) -> None:
    for i in (0, 1):
        ckpt_dir = tmp_path / f"node{i}" / "checkpoints"
        assert not list(ckpt_dir.glob("step_*")), list(ckpt_dir.iterdir())


def test_sigterm_to_one_node_commits_in_the_bucket_and_two_fresh_nodes_resume(
    supervised_launches: list[Supervised],
    torchrun: Callable[..., Torchrun],
    s3_server: SeaweedS3,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    mirror = f"s3://{s3_bucket}/run"
    storage = open_storage(mirror)
    nodes = _nodes(supervised_launches, tmp_path, mirror, s3_server.env())
    first = _wait_first_checkpoint(storage, nodes)
    nodes[1].proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    seen = _watch_bucket(storage, nodes)
    assert [n.wait(30) for n in nodes] == [75, 75], nodes[0].err + "\n" + nodes[1].err

    final = max(seen)
    print(
        f"SIGTERM to node 1 -> manifest of step {final} in the bucket: {seen[final] - sent:.2f} s"
    )
    assert final > first, seen
    manifest = verify_checkpoint(storage, final)
    assert (manifest.world_size, manifest.format) == (2, "torch-dcp")
    assert manifest.extra["reason"] == "stop", manifest.extra
    # every rank's files, all in the one attempt dir the ranks uploaded to
    attempts = {f.path.split("/", 1)[0] for f in manifest.files}
    assert len(attempts) == 1, attempts
    assert {f.path.split("/", 1)[1] for f in manifest.files} == RANK_FILES
    # both ranks stopped after that step: rank 1 by the SIGTERM forwarded to it, rank 0 by
    # the agreement; neither supervisor judged a local checkpoint
    assert f"stopped by SIGTERM at step {final}: {DURABLE}" in nodes[1].err, nodes[1].err
    assert f"stopped by stop requested on another rank at step {final}: {DURABLE}" in nodes[0].err
    for n in nodes:
        assert f"torchrun --nnodes 2: the ranks commit checkpoints in {mirror} themselves" in n.err
    assert "SIGTERM: forwarded SIGTERM to 1 torchrun worker(s)" in nodes[1].err, nodes[1].err
    assert f"the ranks committed their final checkpoint in {mirror}" in nodes[1].err
    assert "trainer exited 75 on its own (preempted)" in nodes[0].err, nodes[0].err
    _assert_no_local_checkpoint(tmp_path)

    # Two fresh nodes: the bucket is all they have.
    for i in (0, 1):
        shutil.rmtree(tmp_path / f"node{i}")
    resumed = _nodes(supervised_launches, tmp_path, mirror, s3_server.env())
    assert [n.wait(400) for n in resumed] == [0, 0], resumed[0].err + "\n" + resumed[1].err
    resumed_line = rf"resumed from the mirror \([^)]*\) \(step {final}, "
    assert re.search(resumed_line, resumed[0].err), resumed[0].err
    assert list_checkpoints(storage)[-1] == STEPS
    _assert_no_local_checkpoint(tmp_path)

    # The same run, never interrupted, on one node with two ranks and no mirror.
    reference = torchrun(
        2, [*DEMO, "--run-dir", str(tmp_path / "reference")], env={"OMP_NUM_THREADS": "1"}
    )
    assert reference.wait(400) == 0, reference.output()
    expected = final_fingerprint(reference.rank_stderr(0))
    assert expected[0] == STEPS
    assert final_fingerprint(resumed[0].err) == expected


# A fake trainer (no checkpoint, no SIGTERM handler): it notes its RUNNER_MIRROR and sleeps.
FAKE_TRAINER = """
import os, sys, time
with open(sys.argv[1] + "." + os.environ["RANK"], "w") as f:
    f.write(os.environ.get("RUNNER_MIRROR", "(unset)"))
time.sleep(120)
"""


def test_fake_trainer_without_a_handler_is_stopped_through_torchrun_and_exits_1(
    supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    """A stop no worker handles yet goes to torchrun itself (it exits 1, no failure summary):
    with no worker's 75 to pass on, each node exits 1 and is not restarted."""
    script, noted = tmp_path / "trainer.py", tmp_path / "mirror-seen"
    script.write_text(FAKE_TRAINER)
    mirror = tmp_path / "bucket"
    port = str(free_port())
    nodes = []
    for i in (0, 1):
        args = [
            "--run-dir", str(tmp_path / f"node{i}"), "--mirror", str(mirror),
            "--grace-seconds", "20", "--", sys.executable, "-m", "torch.distributed.run",
            "--nnodes=2", "--node-rank", str(i), "--nproc-per-node", "1",
            "--master-addr", "127.0.0.1", "--master-port", port, str(script), str(noted),
        ]  # fmt: skip
        nodes.append(Supervised(args))
        supervised_launches.append(nodes[-1])
    end = time.monotonic() + 120
    while not all(Path(f"{noted}.{rank}").exists() for rank in (0, 1)):
        assert all(n.proc.poll() is None for n in nodes), nodes[0].err + nodes[1].err
        assert time.monotonic() < end, nodes[0].err + nodes[1].err
        time.sleep(0.05)
    # the trainer got the normalised mirror URI, which the supervisor did not strip
    assert [Path(f"{noted}.{rank}").read_text() for rank in (0, 1)] == [mirror.as_uri()] * 2
    for n in nodes:
        n.proc.send_signal(signal.SIGTERM)
    assert [n.wait(60) for n in nodes] == [1, 1], nodes[0].err + "\n" + nodes[1].err
    for n in nodes:
        assert "forwarded SIGTERM to torchrun (no worker handles SIGTERM yet)" in n.err, n.err
        assert "the ranks did not report a committed final checkpoint" in n.err, n.err
        assert "exiting 1, not 75" in n.err, n.err
        assert n.err.count("started trainer pid") == 1  # a stop is never restarted
    assert not mirror.exists()  # the supervisor put nothing there: it runs no mirror
