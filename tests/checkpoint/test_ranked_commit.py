"""The multi-rank commit protocol (runner.checkpoint.ranked) in one process: a world of one
(Group SINGLE) writes a real torch-dcp checkpoint through the same code every rank runs, so
the layout, the manifest, verification (counters included) and the load back are checked
without launching ranks (tests/e2e/test_multirank*.py launch them)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runner.checkpoint.formats.dcp import DCP_METADATA, TRAIN_STATE_FILE, rank_file_name
from runner.checkpoint.manifest import FORMAT_DCP
from runner.checkpoint.ranked import load_ranked, write_ranked
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter
from runner.collective.group import SINGLE
from runner.errors import CheckpointWriteError, IntegrityError
from runner.state.train_state import ModuleTrainState
from tests.fixtures.dcp_ranks import meta_of, module_state, train_steps
from tests.fixtures.torchrun import GlooWorld

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _commit(state: ModuleTrainState, ckpt_dir: Path) -> Path:
    meta = meta_of(state)
    writer = CheckpointWriter(ckpt_dir, run_id="r" * 16, writer_id="test")
    part = state.capture_ranked(rank=0, world_size=1)
    return write_ranked(writer, part, meta=meta, group=SINGLE).path


def test_a_world_of_one_commits_the_documented_layout_and_loads_back_exactly(
    tmp_path: Path,
) -> None:
    saved = module_state()
    train_steps(saved, 5)
    step_dir = _commit(saved, tmp_path / "checkpoints")
    rng_after_save = torch.get_rng_state()

    assert step_dir.name == "step_000005"
    names = sorted(p.name for p in step_dir.iterdir())
    assert names == sorted(
        [DCP_METADATA, "__0_0.distcp", rank_file_name(0), TRAIN_STATE_FILE, "manifest.json"]
    )
    manifest = verify_dir(step_dir)  # sizes, sha256, counters in train_state.pt
    assert (manifest.format, manifest.schema, manifest.world_size) == (FORMAT_DCP, "4", 1)
    assert (manifest.step, manifest.samples_seen) == (5, 20)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]

    resumed = module_state(seed=0)
    torch.manual_seed(123)  # the load must bring the saved RNG back
    counters = load_ranked(resumed, step_dir, manifest, group=SINGLE)
    assert counters == saved.counters
    assert resumed.fingerprint() == saved.fingerprint() == manifest.fingerprint
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    assert resumed.loss_history == saved.loss_history
    # both continue identically: the optimizer state and the data position came back too
    train_steps(saved, 3)
    torch.set_rng_state(rng_after_save)
    train_steps(resumed, 3)
    assert resumed.fingerprint() == saved.fingerprint()


def test_a_manifest_whose_counters_disagree_with_train_state_is_refused(tmp_path: Path) -> None:
    state = module_state()
    train_steps(state, 4)
    step_dir = _commit(state, tmp_path / "checkpoints")
    path = step_dir / "manifest.json"
    forged = json.loads(path.read_text())
    forged["samples_seen"] = 999  # files untouched: only rule 4 can tell
    path.write_text(json.dumps(forged))
    with pytest.raises(IntegrityError, match=r"samples_seen: manifest 999, payload 16"):
        verify_dir(step_dir)


HERE = "tests.checkpoint.test_ranked_commit"


class _FakeStagingFailsWriter(CheckpointWriter):
    """Fault injection (a fake): rank 0 cannot create the staging directory (ENOSPC)."""

    def staging(self, step: int):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device (injected)")


def _worker_staging_fails(ckpt_dir: str) -> None:
    from runner.collective.group import dedicated_group

    group = dedicated_group(timeout_s=60)
    state = module_state()
    train_steps(state, 2)
    writer_class = _FakeStagingFailsWriter if group.rank == 0 else CheckpointWriter
    writer = writer_class(Path(ckpt_dir), run_id="r" * 16, writer_id="test")
    meta = CheckpointMeta(
        step=2, samples_seen=8, world_size=2, epoch=0, batch_in_epoch=2, fingerprint=""
    )
    part = state.capture_ranked(rank=group.rank, world_size=2)
    try:
        write_ranked(writer, part, meta=meta, group=group)
    except (OSError, CheckpointWriteError) as exc:
        print(json.dumps({"rank": group.rank, "error": type(exc).__name__, "message": str(exc)}))
    group.barrier()  # the ranks still call collectives in step: nothing is left waiting


@pytest.mark.slow
def test_a_staging_failure_on_rank_0_fails_the_save_on_every_rank_without_a_hang(
    gloo_world: Callable[..., GlooWorld], tmp_path: Path
) -> None:
    world = gloo_world(f"{HERE}:_worker_staging_fails", 2, str(tmp_path / "checkpoints"))
    finished = world.wait(timeout=90)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    outcomes = [json.loads(f.stdout) for f in finished]
    assert outcomes[0]["error"] == "OSError"
    assert outcomes[1]["error"] == "CheckpointWriteError"
    assert outcomes[1]["message"].startswith(
        "the checkpoint was not committed: rank 0: could not create the staging directory: "
    )
    assert "No space left on device (injected)" in outcomes[1]["message"]
    assert not list((tmp_path / "checkpoints").glob("step_*"))


def _fake_write_part_then_truncate(write_part: Callable[..., object]) -> Callable[..., object]:
    """Fault injection (a fake): this rank's rank file loses its second half after it was
    written and reported at its full size (a file rank 0 would see short)."""

    def wrapped(stage, part, group):  # type: ignore[no-untyped-def]
        entries = write_part(stage, part, group)
        path = stage.path / rank_file_name(part.rank)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return entries

    return wrapped


def _worker_presence(how: str, base: str) -> None:
    """Both ranks commit step 2; rank 1's part is not in rank 0's staging dir as reported:
    `missing` (rank 1 writes into a run dir of its own, as one given another --run-dir
    does) or `short` (same run dir, its rank file truncated after it reported it)."""
    from runner.checkpoint import ranked
    from runner.collective.group import dedicated_group

    group = dedicated_group(timeout_s=60)
    torch.set_num_threads(1)
    state = module_state(rank=group.rank, world=2)
    train_steps(state, 2)
    run_dir = "node" if group.rank == 0 or how == "short" else "other"
    ckpt_dir = Path(base) / run_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if how == "short" and group.rank == 1:
        ranked.write_part = _fake_write_part_then_truncate(ranked.write_part)  # type: ignore[assignment]
    writer = CheckpointWriter(ckpt_dir, run_id="r" * 16, writer_id="test")
    part = state.capture_ranked(rank=group.rank, world_size=2)
    try:
        write_ranked(writer, part, meta=meta_of(state), group=group)
        outcome = {"rank": group.rank, "error": None, "message": "committed"}
    except CheckpointWriteError as exc:
        outcome = {"rank": group.rank, "error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(outcome))
    group.barrier()  # the ranks still call collectives in step: nothing is left waiting


@pytest.mark.slow
@pytest.mark.parametrize("how", ["missing", "short"])
def test_rank_0_never_commits_a_manifest_naming_a_file_it_cannot_see_at_its_size(
    gloo_world: Callable[..., GlooWorld], tmp_path: Path, how: str
) -> None:
    world = gloo_world(f"{HERE}:_worker_presence", 2, how, str(tmp_path))
    finished = world.wait(timeout=120)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    outcomes = [json.loads(f.stdout) for f in finished]
    assert [o["error"] for o in outcomes] == ["CheckpointWriteError"] * 2, outcomes
    staged = re.escape(str(tmp_path / "node" / "checkpoints" / ".tmp-step_000002-"))
    if how == "missing":
        lost = rf"__1_0\.distcp missing, {re.escape(rank_file_name(1))} missing"
    else:
        lost = rf"{re.escape(rank_file_name(1))} (\d+) bytes, not (\d+)"
    for rank, outcome in enumerate(outcomes):
        expected = (
            rf"the checkpoint was not committed: rank 1: its files are not in rank 0's "
            rf"staging directory {staged}\S+ as written: {lost}; the ranks of one node must "
            rf"share one --run-dir on one file system{' [(]this one[)]' if rank == 1 else ''}"
            rf"\. Nothing partial is visible; the previous checkpoint is intact"
        )
        match = re.fullmatch(expected, outcome["message"])
        assert match, (expected, outcome["message"])
        if how == "short":
            assert int(match[1]) * 2 in (int(match[2]), int(match[2]) - 1), match[0]
    assert not list(tmp_path.rglob("manifest.json"))
    assert not list(tmp_path.rglob("step_000002"))
