"""The ranks' own gloo group (runner.session.placement.ranks_group) marks the process to end
without the interpreter's teardown: gloo's threads outlive the group, and a framework's rank
that finished and then freed what they hold in that teardown aborted (SIGABRT, "terminate
called without an active exception", seen under an HF Trainer on 2 ranks). A launch of one
process makes no group and leaves the normal exit alone."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.config import RunConfig
from runner.preemption import exiting
from runner.runtime.rank import SINGLE_PROCESS, RankContext
from runner.session.placement import ranks_group
from tests.fixtures.torchrun import GlooWorld

HERE = "tests.session.test_ranks_group_exit"


def _worker(base: str) -> None:
    import torch.distributed as dist

    exiting._native_threads.clear()  # the bare world set it for itself (tests/fixtures)
    r = dist.get_rank()
    rank = RankContext(rank=r, world_size=2, local_rank=r, local_world_size=2, coordinated=True)
    group = ranks_group(rank, RunConfig(run_dir=Path(base) / "run", collective_timeout=60))
    print(json.dumps({"single": group.single, "no_teardown": exiting._native_threads.is_set()}))
    sys.stdout.flush()
    (Path(base) / f"done{r}").touch()
    # rank 0's process holds the store the group was made through: it ends last, or rank 1,
    # still finishing with the group, can find its peer gone (seen once under load: exit 1)
    deadline = time.monotonic() + 60
    while r == 0 and not (Path(base) / "done1").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
def test_the_ranks_group_ends_its_process_without_the_teardown(
    gloo_world: Callable[..., GlooWorld], tmp_path: Path
) -> None:
    world = gloo_world(f"{HERE}:_worker", 2, str(tmp_path))
    finished = world.wait(timeout=120)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    assert [json.loads(f.stdout) for f in finished] == [{"single": False, "no_teardown": True}] * 2


def test_one_process_makes_no_group_and_keeps_the_normal_exit(tmp_path: Path) -> None:
    exiting._native_threads.clear()
    group = ranks_group(SINGLE_PROCESS, RunConfig(run_dir=tmp_path / "run"))
    assert group.single
    assert not exiting._native_threads.is_set()
