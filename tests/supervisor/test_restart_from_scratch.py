"""A restart with no checkpoint to resume from: the supervisor (not the trainer) marks the
crashed attempt's logged steps superseded in loss.jsonl and counts them lost, as it always
has (a TrainSession leaves loss.jsonl alone when it finds no checkpoint:
tests/session/test_resume_report.py). The C seed trainer, a real RunnerMetrics registry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
from prometheus_client import CollectorRegistry

from runner.checkpoint.loss_log import LossLog
from runner.config import RunConfig
from runner.errors import ChildFailedError
from runner.metrics.registry import RunnerMetrics
from runner.preemption.stop import StopController
from runner.supervisor.supervise import Supervisor

N = 16  # the seed trainer's parameters


@pytest.fixture
def child_log(tmp_path: Path) -> Iterator[BinaryIO]:
    with open(tmp_path / "child.log", "wb") as f:
        yield f


def test_a_restart_from_scratch_supersedes_the_crashed_attempts_steps(
    tmp_path: Path,
    seed_trainer: Path,
    monkeypatch: pytest.MonkeyPatch,
    child_log: BinaryIO,
) -> None:
    monkeypatch.setenv("TRAINER_ALWAYS_CRASH_AT", "2")  # before its first checkpoint (5)
    registry = CollectorRegistry()
    controller = StopController()
    sup = Supervisor(
        [str(seed_trainer), "12", str(N), "1", "5"],
        config=RunConfig(run_dir=tmp_path / "run", max_restarts=1, writer_id="pod-a"),
        controller=controller,
        metrics=RunnerMetrics(registry),
        restart_backoff=0.01,
        scan_interval=0.05,
        stdout=child_log,
        stderr=child_log,
    )
    try:
        with pytest.raises(ChildFailedError) as failed:  # both attempts crash after step 2
            sup.run()
    finally:
        controller.close()
    assert failed.value.exit_code == 1
    assert sup.attempts == 2
    records = [
        {k: v for k, v in json.loads(line).items() if k not in ("t", "loss")}
        for line in (tmp_path / "run" / "loss.jsonl").read_text().splitlines()
    ]
    assert records[:2] == [{"step": 1}, {"step": 2}]  # the first attempt (the trainer's)
    assert records[2] == {"resume_from": 0, "attempt": "pod-a/2"}  # the supervisor's marker
    assert records[3:] == [{"step": 1}, {"step": 2}]  # the second attempt
    assert registry.get_sample_value("runner_resumes_total") == 1.0
    assert registry.get_sample_value("runner_steps_lost_total") == 2.0
    assert sorted(LossLog(tmp_path / "run").read()) == [1, 2]
