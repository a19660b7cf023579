"""`runner demo --parallel fsdp` on 2 ranks under real torchrun (gloo, CPU): FSDP2 shards the
model and optimizer state, each rank writes its shards, and the fingerprint is the full state's.

- test_sigterm_to_torchrun_then_same_command_is_exact: SIGTERM to torchrun once a periodic
  checkpoint is committed; the same command ends at the straight fsdp run's fingerprint with its
  loss history. The stopped checkpoint's DCP index shows every optimizer tensor in two disjoint
  row shards, one in each rank's data file (a DDP checkpoint has one whole copy of each).
- test_fsdp_checkpoint_loaded_at_one_rank_fingerprints_as_saved: the straight run's final
  2-rank checkpoint resumed by one plain process (no FSDP: DCP reshards) fingerprints as its
  manifest says: equal states, equal fingerprints at any world size.
- test_ddp_checkpoint_resumes_under_fsdp: the DDP run's final checkpoint resumed by the same
  command with RUNNER_PARALLEL=fsdp holds the DDP run's state, optimizer state included.
- test_one_process_checkpoint_resumes_under_fsdp: a whole-file checkpoint of one process loads
  into 2 fsdp ranks (each keeps its shard of the full state) with the same fingerprint.
"""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from runner.checkpoint.loss_log import LossLog
from tests.fixtures.demo_process import checkpoint_steps, logged_steps, manifest
from tests.fixtures.multirank import (
    EVERY,
    Plain,
    Straight,
    demo_args,
    final_fingerprint,
    rank_exits,
    straight_run,
    wait_until,
)
from tests.fixtures.torchrun import Torchrun

pytestmark = pytest.mark.e2e

STEPS = 40
FSDP = ("--parallel", "fsdp")
DATA_FILES = ("__0_0.distcp", "__1_0.distcp")


@pytest.fixture(scope="module")
def straight_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Straight]:
    """One uninterrupted 2-rank fsdp run of STEPS steps."""
    base = tmp_path_factory.mktemp("straight-fsdp")
    with straight_run(base, demo_args(base / "run", *FSDP, steps=STEPS), steps=STEPS) as straight:
        yield straight


def optimizer_shards(step_dir: Path) -> dict[str, list[tuple[str, int, int]]]:
    """Each optimizer tensor of at least one dimension (exp_avg, exp_avg_sq) in the DCP index:
    (data file, first row, rows) of every stored chunk, by first row."""
    metadata = FileSystemReader(str(step_dir)).read_metadata()
    shards: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata[index.fqn]
        if not index.fqn.startswith("optimizer.state.") or not isinstance(
            entry, TensorStorageMetadata
        ):
            continue
        if len(entry.size) == 0:  # AdamW's step: a scalar, replicated
            continue
        (chunk,) = [c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset)]
        shards.setdefault(index.fqn, []).append(
            (info.relative_path, chunk.offsets[0], chunk.sizes[0])
        )
    return {fqn: sorted(found, key=lambda s: s[1]) for fqn, found in shards.items()}


def assert_sharded_by_rank(step_dir: Path) -> None:
    shards = optimizer_shards(step_dir)
    metadata = FileSystemReader(str(step_dir)).read_metadata()
    # 2 layers x 12 + embeddings 2 + ln_f 2 + head 1 = 29 parameters, exp_avg and exp_avg_sq
    assert len(shards) == 2 * 29
    for fqn, found in shards.items():
        rows = metadata.state_dict_metadata[fqn].size[0]  # type: ignore[union-attr]
        assert [path for path, _, _ in found] == list(DATA_FILES), (fqn, found)
        (_, first0, rows0), (_, first1, rows1) = found
        assert (first0, first1, rows0 + rows1) == (0, rows0, rows), (fqn, found)
        assert rows0 == -(-rows // 2), (fqn, found)  # rank 0 holds ceil(rows / 2)
    sizes = [(step_dir / name).stat().st_size for name in DATA_FILES]
    assert abs(sizes[0] - sizes[1]) <= 0.2 * max(sizes), sizes


def test_sigterm_to_torchrun_then_same_command_is_exact(
    torchrun: Callable[..., Torchrun], tmp_path: Path, straight_fsdp: Straight
) -> None:
    run_dir = tmp_path / "run"
    command = demo_args(run_dir, *FSDP, steps=STEPS)
    first = torchrun(2, command)
    wait_until(lambda: bool(checkpoint_steps(run_dir)), lambda: first.proc.poll() is None,
               "periodic checkpoint")  # fmt: skip
    first.signal(signal.SIGTERM)
    first.wait(90)
    assert rank_exits(first) == {0: 75, 1: 75}, first.output()
    stopped = max(logged_steps(run_dir))
    assert EVERY <= stopped < STEPS
    assert checkpoint_steps(run_dir)[-1] == stopped
    assert_sharded_by_rank(run_dir / "checkpoints" / f"step_{stopped:06d}")

    again = torchrun(2, command)
    assert again.wait(180) == 0, again.output()
    assert rank_exits(again) == {0: 0, 1: 0}, again.output()
    assert f"resuming from local checkpoint step {stopped}" in again.rank_stderr(0)
    assert final_fingerprint(again.rank_stderr(0)) == (STEPS, straight_fsdp.fingerprint)
    assert manifest(run_dir, STEPS)["fingerprint"] == straight_fsdp.fingerprint
    assert LossLog(run_dir).read() == straight_fsdp.losses
    assert_sharded_by_rank(run_dir / "checkpoints" / f"step_{STEPS:06d}")


def test_fsdp_checkpoint_loaded_at_one_rank_fingerprints_as_saved(
    plain_demo: Callable[..., Plain], tmp_path: Path, straight_fsdp: Straight
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(straight_fsdp.run_dir, run_dir)
    alone = plain_demo(run_dir, *FSDP, "--steps", str(STEPS))  # --parallel: ignored alone
    assert alone.wait() == 0, alone.output()
    text = alone.output()
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{STEPS:06d}'} (step {2 * STEPS}," in (
        text
    )
    # the samples of the 2-rank run's STEPS steps are 2 * STEPS steps of one process: done
    assert final_fingerprint(text) == (2 * STEPS, straight_fsdp.fingerprint)
    assert manifest(run_dir, 2 * STEPS)["fingerprint"] == straight_fsdp.fingerprint


def test_ddp_checkpoint_resumes_under_fsdp(
    torchrun: Callable[..., Torchrun], tmp_path: Path, straight_2rank: Straight
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(straight_2rank.run_dir, run_dir)
    step = int(straight_2rank.manifest["step"])  # type: ignore[call-overload]
    launch = torchrun(2, demo_args(run_dir), env={"RUNNER_PARALLEL": "fsdp"})
    assert launch.wait(180) == 0, launch.output()
    assert "fully_shard: 2 blocks and the root over 2 ranks" in launch.rank_stderr(1)
    assert f"resuming from local checkpoint step {step}" in launch.rank_stderr(0)
    assert final_fingerprint(launch.rank_stderr(0)) == (step, straight_2rank.fingerprint)


def test_one_process_checkpoint_resumes_under_fsdp(
    plain_demo: Callable[..., Plain], torchrun: Callable[..., Torchrun], tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    # one checkpoint, at the end: the 2-rank resume's final save (step 10) has no namesake
    alone = plain_demo(run_dir, "--steps", "20", "--ckpt-every", "20")
    assert alone.wait() == 0, alone.output()
    _, saved = final_fingerprint(alone.output())
    assert manifest(run_dir, 20)["format"] != "torch-dcp"

    launch = torchrun(2, demo_args(run_dir, *FSDP, steps=20, ckpt_every=20))
    assert launch.wait(180) == 0, launch.output()
    assert rank_exits(launch) == {0: 0, 1: 0}, launch.output()
    assert final_fingerprint(launch.rank_stderr(0)) == (10, saved)
    assert manifest(run_dir, 10)["fingerprint"] == saved
    assert_sharded_by_rank(run_dir / "checkpoints" / "step_000010")
