"""A save's own facts travel in its Snapshot (when it began) and a failure is classified where
it happens (runner/session/checkpointer.py persist): before the commit it is the save's
(`on_failure`), after it (bookkeeping, retention, the hand-off) it propagates as it is. With a
saver that keeps a save in flight while the loop goes on (a fake: it only records), the
previous save's bookkeeping reads its own start time, and the next save's failure is still
the save's. The TrainSession's sync saver: same messages, metrics and step_done handling."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.errors import CheckpointConflictError, CheckpointWriteError
from runner.session.checkpointer import Checkpointer, Snapshot
from runner.session.train_session import TrainSession
from runner.state.train_state import ModuleTrainState
from runner.storage.file import FileStorage
from tests.fixtures.savers import FakeInFlightSaver
from tests.fixtures.train_loop import config, new_state, train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def writer(tmp_path: Path) -> CheckpointWriter:
    return CheckpointWriter(tmp_path / "checkpoints", run_id="run-1", writer_id="w")


def trained(steps: int) -> ModuleTrainState:
    state = new_state()
    for _ in range(steps):
        train_step(state)
    return state


def _fail_step(ckpt: Checkpointer, step: int, exc: Exception) -> None:
    """Fault injection: the writer raises `exc` when it commits step `step`."""
    real = ckpt.writer.write_state

    def write_state(payload: dict[str, Any], *, meta: CheckpointMeta) -> CommittedCheckpoint:
        if meta.step == step:
            raise exc
        return real(payload, meta=meta)

    ckpt.writer.write_state = write_state  # type: ignore[method-assign]


def test_fake_in_flight_saver_bookkeeping_reads_its_own_save_and_failures_stay_the_saves(
    tmp_path: Path,
) -> None:
    committed: list[tuple[int, float]] = []
    failed: list[tuple[str, int]] = []

    def on_failure(exc: Exception, step: int) -> Exception:
        failed.append((type(exc).__name__, step))
        return CheckpointWriteError(f"step {step} not written")

    ckpt = Checkpointer(
        writer(tmp_path),
        on_commit=lambda c, snap: committed.append((snap.step, snap.captured_at)),
        on_failure=on_failure,
        saver=FakeInFlightSaver,
    )
    full = OSError(errno.ENOSPC, "No space left on device")
    _fail_step(ckpt, 2, full)
    state = trained(1)
    first_began = time.monotonic()
    ckpt.save(state, reason="steps")  # in flight: the loop goes on
    time.sleep(0.2)
    train_step(state)
    second_began = time.monotonic()
    ckpt.save(state, reason="steps")  # commits step 1 first, then captures step 2
    assert [step for step, _ in committed] == [1]
    assert first_began <= committed[0][1] < second_began  # step 1's own start, not step 2's
    assert failed == []
    with pytest.raises(CheckpointWriteError, match="step 2 not written") as caught:
        ckpt.wait_for_saving()  # step 2's commit fails: the save's, though step 1 committed
    assert caught.value.__cause__ is full
    assert failed == [("OSError", 2)]
    assert list_checkpoints(FileStorage(tmp_path)) == [1]


def test_fake_refused_commit_is_classified_and_reraised_as_it_is(tmp_path: Path) -> None:
    seen: list[Exception] = []

    def on_failure(exc: Exception, step: int) -> Exception:
        seen.append(exc)
        return exc  # a RunnerError stays what it is

    ckpt = Checkpointer(writer(tmp_path), on_failure=on_failure)
    refused = CheckpointConflictError("step 1 exists with other contents")
    _fail_step(ckpt, 1, refused)
    with pytest.raises(CheckpointConflictError) as caught:
        ckpt.save(trained(1), reason="steps")
    assert caught.value is refused and caught.value.__cause__ is None
    assert seen == [refused]


def test_fake_failing_hand_off_after_the_commit_is_not_a_failed_save(tmp_path: Path) -> None:
    seen: list[Exception] = []

    def hand_off(committed: CommittedCheckpoint, snapshot: Snapshot) -> None:
        raise OSError(errno.EIO, "the mirror's queue broke")

    def on_failure(exc: Exception, step: int) -> Exception:
        seen.append(exc)
        return exc

    ckpt = Checkpointer(writer(tmp_path), hand_off=hand_off, on_failure=on_failure)
    with pytest.raises(OSError, match="the mirror's queue broke"):
        ckpt.save(trained(1), reason="steps")
    assert seen == []  # after the commit: the checkpoint stands
    assert list_checkpoints(FileStorage(tmp_path)) == [1]


def _failures(session: TrainSession) -> float | None:
    assert session.metrics is not None
    return session.metrics.registry.get_sample_value(
        "runner_checkpoint_failures_total", {"stage": "save"}
    )


def test_fake_full_disk_session_save_fails_with_advice_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path, mirror=False, ckpt_every=2, keep=5)
    state = new_state()
    session = TrainSession(cfg, state=state)
    try:
        session.restore()
        _fail_step(session.checkpointer, 4, OSError(errno.ENOSPC, "No space left on device"))
        with caplog.at_level(logging.INFO, logger="runner"):
            for _ in range(4):
                train_step(state)
                assert session.step_done() is False  # the failed save at 4 stops nothing
        assert _failures(session) == 1.0
        with pytest.raises(CheckpointWriteError) as caught:
            session.save(reason="signal")  # step 4 again: the same failure, raised
        assert isinstance(caught.value.__cause__, OSError)
        assert _failures(session) == 2.0
    finally:
        session.close()
    ckpt_dir = Path(cfg.run_dir) / "checkpoints"
    message = (
        f"checkpoint at step 4 could not be written to {ckpt_dir}: No space left on device; "
        "the previous checkpoint: step 2 is intact. "
    )
    assert str(caught.value).startswith(message)
    assert f"{message}" in caplog.text and "; training continues" in caplog.text
    assert "checkpoint step 2 committed in " in caplog.text
    assert list_checkpoints(FileStorage(Path(cfg.run_dir))) == [2]


def test_fake_failing_mirror_hand_off_session_save_raises_it_uncounted(tmp_path: Path) -> None:
    cfg = config(tmp_path, mirror=True, keep=5)
    state = new_state()
    session = TrainSession(cfg, state=state)
    try:
        session.restore()
        assert session.mirror is not None

        def submit(ckpt: CommittedCheckpoint) -> None:
            raise OSError(errno.EIO, "the mirror's queue broke")

        session.mirror.submit = submit  # type: ignore[method-assign]
        train_step(state)
        with pytest.raises(OSError, match="the mirror's queue broke") as caught:
            session.save(reason="signal")
        assert not isinstance(caught.value, CheckpointWriteError)
        assert _failures(session) == 0.0  # committed: not a failed save
        assert session.last_checkpoint is not None and session.last_checkpoint.step == 1
    finally:
        session.close()
