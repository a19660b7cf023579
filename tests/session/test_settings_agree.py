"""TrainSession's own settings check (runner.session.coordination.agree_on_settings) on 2 real
gloo ranks, for a user's loop (the demo compares its settings earlier too): ranks of one node
given different run dirs, --steps, --save-mode and a job setting all raise the same
ConfigError naming each rank's value, before any checkpoint dir exists, and before the async
rank creates its save group (a collective the sync rank would never join); two ranks on
different nodes, each with its own run dir and the same mirror, start."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.config import RunConfig
from runner.errors import ConfigError
from runner.runtime.rank import RankContext
from runner.session.train_session import TrainSession
from tests.fixtures.dcp_ranks import module_state
from tests.fixtures.torchrun import GlooWorld

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HERE = "tests.session.test_settings_agree"


def _worker_session(case: str, base: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    r = dist.get_rank()
    if case == "one node":
        rank = RankContext(rank=r, world_size=2, local_rank=r, local_world_size=2, coordinated=True)
        config = RunConfig(
            run_dir=Path(base) / f"run{r}", steps=(40, 60)[r], save_mode=("async", "sync")[r],
            collective_timeout=60, writer_id=f"rank{r}",
        )  # fmt: skip
        job = {"--batch-size": (4, 8)[r]}
    else:  # each rank a node of its own: own run dirs are right there
        rank = RankContext(
            rank=r, world_size=2, local_rank=0, local_world_size=1, node_rank=r, coordinated=True
        )
        config = RunConfig(
            run_dir=Path(base) / f"node{r}", steps=40, mirror=(Path(base) / "bucket").as_uri(),
            collective_timeout=60, writer_id=f"rank{r}",
        )  # fmt: skip
        job = {"--batch-size": 4}
    try:
        session = TrainSession(
            config, state=module_state(rank=r, world=2), rank=rank, job_settings=job
        )
    except ConfigError as exc:
        print(json.dumps({"error": str(exc)}))
    else:
        session.close()
        print(json.dumps({"error": None}))


@pytest.mark.slow
def test_ranks_of_one_node_given_different_settings_all_refuse(
    gloo_world: Callable[..., GlooWorld], tmp_path: Path
) -> None:
    world = gloo_world(f"{HERE}:_worker_session", 2, "one node", str(tmp_path))
    finished = world.wait(timeout=120)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    errors = [json.loads(f.stdout)["error"] for f in finished]
    assert errors[0] == errors[1], errors
    lines = errors[0].splitlines()
    assert lines[0] == "the ranks of this job were not given the same settings:"
    assert lines[1:5] == [
        f"  --run-dir differs between the ranks of node 0: rank 0: {tmp_path.resolve()}/run0, "
        f"rank 1: {tmp_path.resolve()}/run1",
        "  --steps differs between ranks: rank 0: 40, rank 1: 60",
        "  --save-mode differs between ranks: rank 0: async, rank 1: sync",
        "  --batch-size differs between ranks: rank 0: 4, rank 1: 8",
    ], lines
    assert lines[5].startswith("give every rank the same options"), lines
    assert len(lines) == 6, lines
    for r in (0, 1):
        assert not (tmp_path / f"run{r}" / "checkpoints").exists()


@pytest.mark.slow
def test_ranks_on_different_nodes_may_have_their_own_run_dirs(
    gloo_world: Callable[..., GlooWorld], tmp_path: Path
) -> None:
    world = gloo_world(f"{HERE}:_worker_session", 2, "nodes", str(tmp_path))
    finished = world.wait(timeout=120)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    assert [json.loads(f.stdout)["error"] for f in finished] == [None, None]
