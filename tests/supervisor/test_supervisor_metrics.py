"""The Supervisor in-process with a real RunnerMetrics registry and the C seed trainer:
metrics follow adoptions, the trainer's loss.jsonl and resumes; loss.jsonl stays one loss
per step on the surviving path across a crash."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
from prometheus_client import CollectorRegistry

from runner.checkpoint.loss_log import LossLog
from runner.config import RunConfig
from runner.metrics.registry import RunnerMetrics
from runner.preemption.stop import StopController
from runner.supervisor.supervise import Supervisor

N = 16


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.02)


@pytest.fixture
def child_log(tmp_path: Path) -> Iterator[BinaryIO]:
    with open(tmp_path / "child.log", "wb") as f:
        yield f


def _supervisor(
    tmp_path: Path,
    command: list[str],
    metrics: RunnerMetrics,
    controller: StopController,
    log: BinaryIO,
) -> Supervisor:
    return Supervisor(
        command,
        config=RunConfig(run_dir=tmp_path / "run", max_restarts=2),
        controller=controller,
        metrics=metrics,
        restart_backoff=0.01,
        scan_interval=0.05,
        stdout=log,
        stderr=log,
    )


def test_metrics_follow_checkpoints_steps_and_the_stop(
    tmp_path: Path, seed_trainer: Path, child_log: BinaryIO
) -> None:
    registry = CollectorRegistry()
    metrics = RunnerMetrics(registry)
    controller = StopController()
    sup = _supervisor(
        tmp_path, [str(seed_trainer), "100000", str(N), "5", "10"], metrics, controller, child_log
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()))
    thread.start()
    try:
        _until(
            lambda: (_value(registry, "runner_checkpoint_last_step", location="local") or 0) >= 20
        )
        assert (_value(registry, "runner_train_step") or 0) >= 20
        assert _value(registry, "runner_checkpoint_bytes") == 8 + 12 * N
        controller.request_stop("SIGTERM", deadline=time.monotonic() + 20)
        thread.join(20)
    finally:
        controller.request_stop("test teardown")
        thread.join(20)
        controller.close()
    assert result == [75]
    final = sup.last_checkpoint
    assert final is not None and final.step > 20
    assert _value(registry, "runner_checkpoint_last_step", location="local") == final.step
    assert _value(registry, "runner_train_step") == final.step
    assert _value(registry, "runner_preemption_notices_total", source="sigterm") == 1.0
    assert _value(registry, "runner_resumes_total") == 0.0


def test_crash_resume_counts_lost_steps_and_supersedes_them_in_loss_log(
    tmp_path: Path, seed_trainer: Path, monkeypatch: pytest.MonkeyPatch, child_log: BinaryIO
) -> None:
    monkeypatch.setenv("TRAINER_CRASH_AT", "8")  # checkpoints at 5, crash after 8: 3 lost
    registry = CollectorRegistry()
    metrics = RunnerMetrics(registry)
    controller = StopController()
    sup = _supervisor(
        tmp_path, [str(seed_trainer), "12", str(N), "1", "5"], metrics, controller, child_log
    )
    try:
        assert sup.run() == 0
    finally:
        controller.close()
    assert sup.attempts == 2
    assert _value(registry, "runner_resumes_total") == 1.0
    assert _value(registry, "runner_steps_lost_total") == 3.0
    lines = (tmp_path / "run" / "loss.jsonl").read_text().splitlines()
    assert len(lines) == 8 + 1 + 7  # first attempt, the supersede marker, the redo
    assert '"resume_from":5' in lines[8]  # written by the supervisor before the restart
    losses = LossLog(tmp_path / "run").read()
    assert sorted(losses) == list(range(1, 13))
