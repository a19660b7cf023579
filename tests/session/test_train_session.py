"""TrainSession, in process, through its public API only (constructor, restore, step_done,
save, finish, should_stop, step, target_reached, close and the context manager): a tiny
torch model and ModuleTrainState, real files in a run dir and a real file:// mirror."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.verify import verify_checkpoint
from runner.config import RunConfig
from runner.errors import EXIT_INTEGRITY, UnusableCheckpointsError
from runner.preemption.stop import StopController
from runner.session.train_session import TrainSession
from runner.state.fingerprint import fingerprint_state
from runner.state.train_state import ModuleTrainState
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import tree_hashes
from tests.fixtures.train_loop import BATCH, config, new_state, train_step


def local(cfg: RunConfig) -> FileStorage:
    return FileStorage(Path(cfg.run_dir))


def bucket(tmp_path: Path) -> FileStorage:
    return FileStorage(tmp_path / "bucket")


def snapshot(state: ModuleTrainState) -> dict[str, Any]:
    """Deep copies of everything a resume must bring back."""
    c = state.counters
    return {
        "counters": (c.step, c.samples_seen, c.epoch, c.batch_in_epoch, c.world_size),
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()}
            for i, s in state.optimizer.state_dict()["state"].items()
        },
        "loss_history": list(state.loss_history),
    }


def assert_bit_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["counters"] == want["counters"]
    assert got["loss_history"] == want["loss_history"]
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert got["optimizer"].keys() == want["optimizer"].keys()
    for i, slots in want["optimizer"].items():
        assert got["optimizer"][i].keys() == slots.keys()
        for slot, tensor in slots.items():
            assert torch.equal(got["optimizer"][i][slot], tensor), (i, slot)


def flip_a_payload_byte(run_dir: Path, step: int) -> None:
    storage = FileStorage(run_dir)
    entry = read_manifest(storage, step).files[0]
    path = run_dir / "checkpoints" / f"step_{step:06d}" / entry.path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# -- start ----------------------------------------------------------------------------------


def test_restore_on_an_empty_run_dir_returns_none_and_starts_at_step_0(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=10)
    state = new_state()
    session = TrainSession(cfg, state=state)
    try:
        assert session.restore() is None
        assert session.step == 0
        assert state.counters.step == 0
        assert session.target_reached is False
        assert session.should_stop is False
    finally:
        session.close()
    assert list_checkpoints(local(cfg)) == []
    assert list_checkpoints(bucket(tmp_path)) == []


# -- the step boundary ----------------------------------------------------------------------


def test_step_done_saves_at_exactly_every_nth_step(tmp_path: Path) -> None:
    cfg = config(tmp_path, mirror=False, steps=10, ckpt_every=3, keep=10)
    state = new_state()
    answers = []
    with TrainSession(cfg, state=state) as session:
        while not session.should_stop:
            train_step(state)
            answers.append(session.step_done())
            saved = list_checkpoints(local(cfg))
            assert saved == [s for s in (3, 6, 9) if s <= session.step], session.step
        assert session.target_reached is True
    assert answers == [False] * 9 + [True]  # True once the target is reached
    assert session.exit_code == 0
    assert list_checkpoints(local(cfg)) == [3, 6, 9, 10]  # 10: the final one, from finish()
    reasons = [read_manifest(local(cfg), s).extra["reason"] for s in (3, 6, 9, 10)]
    assert reasons == ["steps", "steps", "steps", "final"]


def test_local_retention_keeps_the_newest_k(tmp_path: Path) -> None:
    cfg = config(tmp_path, mirror=False, steps=10, ckpt_every=2, keep=2)
    state = new_state()
    with TrainSession(cfg, state=state) as session:
        while not session.should_stop:
            train_step(state)
            session.step_done()
    assert session.exit_code == 0
    assert list_checkpoints(local(cfg)) == [8, 10]


def test_save_commits_a_checkpoint_whose_manifest_step_and_fingerprint_match(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, mirror=False, steps=100, ckpt_every=None)
    state = new_state()
    session = TrainSession(cfg, state=state)
    try:  # no finish(): this test is about save() alone
        assert session.restore() is None
        for _ in range(4):
            train_step(state)
            assert session.step_done() is False
        assert list_checkpoints(local(cfg)) == []  # no cadence: nothing saved by step_done
        committed = session.save(reason="manual")
        expected = fingerprint_state(state.model.state_dict(), state.optimizer.state_dict())
    finally:
        session.close()

    assert committed.step == 4
    assert committed.path == Path(cfg.run_dir) / "checkpoints" / "step_000004"
    manifest = verify_checkpoint(local(cfg), 4)  # every file hashed against the manifest
    assert manifest.step == 4
    assert manifest.fingerprint == expected == state.fingerprint()
    assert (manifest.samples_seen, manifest.epoch, manifest.world_size) == (4 * BATCH, 0, 1)
    assert manifest.writer == "pod-a"
    assert manifest.extra["reason"] == "manual"
    assert committed.manifest.to_json() == read_manifest(local(cfg), 4).to_json()


# -- the end --------------------------------------------------------------------------------


def test_a_stop_request_ends_the_loop_and_finish_exits_75_with_the_final_checkpoint_in_both(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, steps=100, ckpt_every=50)
    state = new_state()
    stop = StopController()
    session = TrainSession(cfg, state=state, stop=stop)
    try:
        assert session.restore() is None
        for _ in range(6):
            train_step(state)
            assert session.step_done() is False
        train_step(state)
        stop.request_stop("SIGTERM")  # arrives during step 7
        assert session.should_stop is True
        assert session.step_done() is True
        assert session.step == 7 and session.target_reached is False
        assert list_checkpoints(local(cfg)) == []  # the final checkpoint is finish()'s job
        assert session.finish() == 75
        assert session.exit_code == 75
    finally:
        session.close()
    assert list_checkpoints(local(cfg)) == [7]
    assert list_checkpoints(bucket(tmp_path)) == [7]
    here = verify_checkpoint(local(cfg), 7)
    there = verify_checkpoint(bucket(tmp_path), 7)
    assert here.extra["reason"] == there.extra["reason"] == "stop"
    assert here.fingerprint == there.fingerprint == state.fingerprint()
    assert [(f.size, f.sha256) for f in here.files] == [(f.size, f.sha256) for f in there.files]


def test_finish_at_the_target_exits_0_with_the_final_checkpoint_in_both(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=5, ckpt_every=None)
    state = new_state()
    with TrainSession(cfg, state=state) as session:
        while not session.should_stop:
            train_step(state)
            session.step_done()
        assert session.step == 5 and session.target_reached is True
        assert session.finish() == 0
    assert session.exit_code == 0  # the context manager does not finish twice
    assert list_checkpoints(local(cfg)) == [5]
    assert list_checkpoints(bucket(tmp_path)) == [5]
    assert verify_checkpoint(bucket(tmp_path), 5).extra["reason"] == "final"
    assert verify_checkpoint(bucket(tmp_path), 5).fingerprint == state.fingerprint()


# -- resume ---------------------------------------------------------------------------------


def run_until_stopped(cfg: RunConfig, *, stop_at: int) -> dict[str, Any]:
    """Train from scratch, stop (as on SIGTERM) after step `stop_at`; the state's snapshot."""
    state = new_state(seed=0)
    stop = StopController()
    with TrainSession(cfg, state=state, stop=stop) as session:
        while not session.should_stop:
            train_step(state)
            if session.step == stop_at:
                stop.request_stop("SIGTERM")
            session.step_done()
    assert session.exit_code == 75
    return snapshot(state)


def test_resume_restores_the_exact_counters_weights_and_optimizer_state(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=10, ckpt_every=3)
    at_stop = run_until_stopped(cfg, stop_at=5)
    assert list_checkpoints(local(cfg)) == [3, 5]

    resumed = new_state(seed=99)  # other weights: everything must come from the checkpoint
    session = TrainSession(cfg, state=resumed)
    try:
        assert session.restore() == 5
        assert session.step == 5
        assert_bit_exact(snapshot(resumed), at_stop)
        while not session.should_stop:
            train_step(resumed)
            session.step_done()
        assert session.finish() == 0
    finally:
        session.close()

    # the resumed run ends bit-identical to one that was never interrupted
    straight = new_state(seed=0)
    with TrainSession(config(tmp_path / "straight", steps=10, ckpt_every=3), state=straight) as s:
        while not s.should_stop:
            train_step(straight)
            s.step_done()
    assert_bit_exact(snapshot(resumed), snapshot(straight))


def test_resume_on_a_fresh_run_dir_comes_from_the_mirror(tmp_path: Path) -> None:
    at_stop = run_until_stopped(config(tmp_path, steps=10, ckpt_every=3), stop_at=4)
    fresh = config(tmp_path, steps=10, ckpt_every=3, run_dir=tmp_path / "new-node")
    resumed = new_state(seed=7)
    session = TrainSession(fresh, state=resumed)
    try:
        assert session.restore() == 4
        assert_bit_exact(snapshot(resumed), at_stop)
    finally:
        session.close()
    assert list_checkpoints(local(fresh)) == [4]  # downloaded, verified, committed locally
    assert verify_checkpoint(local(fresh), 4).fingerprint == (
        verify_checkpoint(bucket(tmp_path), 4).fingerprint
    )


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one_and_left_as_it_is(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, mirror=False, steps=10, ckpt_every=3)
    run_until_stopped(cfg, stop_at=6)
    assert list_checkpoints(local(cfg)) == [3, 6]
    flip_a_payload_byte(Path(cfg.run_dir), 6)
    before = tree_hashes(Path(cfg.run_dir) / "checkpoints")

    session = TrainSession(cfg, state=new_state(seed=3))
    try:
        assert session.restore() == 3
        assert session.step == 3
    finally:
        session.close()
    assert tree_hashes(Path(cfg.run_dir) / "checkpoints") == before


def test_refuses_when_the_only_checkpoint_is_corrupt_and_replaces_nothing(
    tmp_path: Path,
) -> None:
    cfg = config(tmp_path, mirror=False, steps=10, ckpt_every=None)
    run_until_stopped(cfg, stop_at=2)
    assert list_checkpoints(local(cfg)) == [2]
    flip_a_payload_byte(Path(cfg.run_dir), 2)
    before = tree_hashes(Path(cfg.run_dir))

    state = new_state(seed=3)
    with pytest.raises(UnusableCheckpointsError) as refused, TrainSession(cfg, state=state):
        pytest.fail("the session must not start on an unusable run dir")
    assert refused.value.exit_code == EXIT_INTEGRITY == 3
    assert "refusing to start: 1 checkpoint(s)" in str(refused.value)
    assert "  - step 2: " in str(refused.value)
    assert state.counters.step == 0
    assert tree_hashes(Path(cfg.run_dir)) == before
    # the refused session let go of the run dir: another one can open it (and refuses too)
    with pytest.raises(UnusableCheckpointsError), TrainSession(cfg, state=new_state()):
        pytest.fail("the session must not start on an unusable run dir")
