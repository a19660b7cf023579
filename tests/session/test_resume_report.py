"""What a TrainSession's start reports in loss.jsonl, the log and the metrics: a resume at
another world size continues from the rescaled step (not the manifest's), and a start with no
checkpoint leaves an earlier loss.jsonl alone (a supervisor marks its restarts itself). A
tiny torch model in ModuleTrainState, real files in a run dir, a real metrics registry."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.loss_log import LossLog
from runner.session.train_session import TrainSession
from runner.state.train_state import ModuleTrainState
from runner.storage.file import FileStorage
from tests.fixtures.train_loop import config, new_state, train_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _loss_lines(run_dir: Path) -> list[dict[str, Any]]:
    """loss.jsonl's records without their wall-clock times."""
    lines = (run_dir / "loss.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "t"} for line in lines]


def _value(session: TrainSession, name: str) -> float | None:
    assert session.metrics is not None
    return session.metrics.registry.get_sample_value(name)


def _sized(world_size: int) -> ModuleTrainState:
    state = new_state()
    return ModuleTrainState(model=state.model, optimizer=state.optimizer, world_size=world_size)


def test_a_resume_at_another_world_size_reports_the_rescaled_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path, mirror=False, ckpt_every=10, keep=5)
    run_dir = Path(cfg.run_dir)
    first = _sized(2)  # two ranks, simulated: a step is two ranks' batches
    session = TrainSession(cfg, state=first)
    try:
        session.restore()
        for _ in range(14):  # committed at 10, then 11..14 logged and lost (no finish)
            train_step(first)
            session.step_done()
    finally:
        session.close()
    assert list_checkpoints(FileStorage(run_dir)) == [10]
    logged = _loss_lines(run_dir)
    assert [line["step"] for line in logged] == list(range(1, 15))

    resumed = _sized(1)  # step 10 at world size 2 is step 20 at 1: nothing logged is lost
    with caplog.at_level(logging.INFO, logger="runner"):
        session = TrainSession(cfg, state=resumed)
        try:
            assert session.restore() == 20
            assert resumed.counters.step == 20
            assert _value(session, "runner_steps_lost_total") == 0.0
            assert _value(session, "runner_train_step") == 20.0
            assert _value(session, "runner_resumes_total") == 1.0
        finally:
            session.close()
    assert _loss_lines(run_dir) == logged  # no supersede marker, nothing backfilled
    assert "supersedes" not in caplog.text
    step_dir = run_dir / "checkpoints" / "step_000010"
    assert f"resumed from {step_dir} (step 20, 50 samples seen)" in caplog.text


def test_a_start_without_a_checkpoint_leaves_an_earlier_loss_log_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path, mirror=False, steps=10)
    run_dir = Path(cfg.run_dir)
    with LossLog(run_dir, attempt="earlier") as losses:  # an attempt that never committed
        for step in (1, 2, 3):
            losses.append(step, float(step))
    before = (run_dir / "loss.jsonl").read_bytes()
    with caplog.at_level(logging.DEBUG, logger="runner"):
        session = TrainSession(cfg, state=new_state())
        try:
            assert session.restore() is None
            assert _value(session, "runner_resumes_total") == 0.0
            assert _value(session, "runner_steps_lost_total") == 0.0
        finally:
            session.close()
    assert (run_dir / "loss.jsonl").read_bytes() == before  # no {"resume_from": 0}
    session_lines = [r.getMessage() for r in caplog.records if r.name.startswith("runner.")]
    assert session_lines == [f"no checkpoint to resume from in {run_dir}: starting at step 0"]
