"""The final upload of a stop never starts a store retry after the stop's deadline: Mirror
upload_now runs the upload under store_deadline(deadline) in its own thread (the deadline is
a context variable, per thread). The store is a fake (no real server answers 500 forever):
the loopback server of test_store_budget, answering every request with an immediate 500."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.errors import EXIT_FAILURE, EXIT_OK
from runner.metrics.registry import RunnerMetrics
from runner.mirror import Mirror
from runner.preemption.stop import StopController
from runner.runtime.services import Services
from runner.session.train_session import TrainSession
from runner.state.train_state import ModuleTrainState
from runner.storage.file import FileStorage
from runner.storage.s3 import S3Storage
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.fake_store import FakeStore, env_for
from tests.fixtures.stalled_store import FakeStalledStore
from tests.fixtures.train_loop import config, new_state, train_step

DEADLINE_S = 8.0


class MonotonicRecords(logging.Handler):
    """Every record with the time.monotonic() instant it was logged at."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[float, logging.LogRecord]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record))


@pytest.fixture
def records() -> Iterator[MonotonicRecords]:
    handler = MonotonicRecords()
    root = logging.getLogger("runner")
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    yield handler
    root.removeHandler(handler)
    root.setLevel(old_level)


@pytest.mark.slow
def test_fake_failing_store_final_upload_starts_no_retry_after_the_deadline(
    tmp_path: Path, records: MonotonicRecords, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = FakeStore("slow-500", delay=0.0)
    for name, value in env_for(store.endpoint).items():
        monkeypatch.setenv(name, value)
    try:
        # the default store timeout (60 s) would keep retrying for far longer than the stop
        mirror = Mirror(S3Storage("bucket", "run"), keep=2, writer_id="pod-a")
        ckpt = make_checkpoint(tmp_path / "run", 10)
        started = time.monotonic()
        deadline = started + DEADLINE_S
        landed = mirror.upload_now(ckpt, deadline=deadline)
        returned = time.monotonic()
        worker = next(
            (t for t in threading.enumerate() if t.name == f"final-upload-{ckpt.step}"), None
        )
        if worker is not None:  # before the fix it went on retrying after the deadline
            worker.join(90)
        ended = time.monotonic()
    finally:
        store.close()
    assert landed is False
    assert returned <= deadline + 1.0, returned - started
    retries = [(at, r.getMessage()) for at, r in records.records if "retrying in" in r.getMessage()]
    # no retry was started (nor waited for) past the deadline
    for at, message in retries:
        wait = float(message.rsplit("retrying in ", 1)[1].rstrip("s"))
        assert at + wait <= deadline, (at - started, message)
    # the upload itself gave up for the deadline (and its thread ended by then)
    assert ended <= deadline + 1.0, ended - started
    assert mirror.last_error is not None and "(the stop deadline)" in mirror.last_error, (
        mirror.last_error
    )
    errors = [r.getMessage() for _, r in records.records if r.levelno >= logging.ERROR]
    assert any("did NOT reach s3://bucket/run" in e and "the stop deadline" in e for e in errors)


def _train_to_the_target_with_a_stop_arriving(
    session: TrainSession, state: ModuleTrainState, stop: StopController, *, steps: int
) -> float:
    """Train to `steps`; a stop without a deadline of its own arrives with the last step.
    Returns the monotonic instant it arrived."""
    arrived = 0.0
    while not session.should_stop:
        train_step(state)
        if session.step == steps:
            arrived = time.monotonic()
            stop.request_stop("SIGTERM")
        session.step_done()
    return arrived


@pytest.mark.slow
def test_fake_stalled_store_a_run_at_its_target_with_a_stop_pending_uploads_within_the_grace(
    tmp_path: Path,
) -> None:
    store = FakeStalledStore(tmp_path / "bucket")
    metrics = RunnerMetrics()
    mirror = Mirror(store, keep=2, writer_id="pod-a", metrics=metrics)
    cfg = config(tmp_path, mirror=False, steps=3, ckpt_every=100, grace_seconds=1.0)
    stop = StopController()
    try:
        services = Services(metrics=metrics, mirror=mirror)
        state = new_state()
        with TrainSession(cfg, state=state, stop=stop, services=services) as session:
            arrived = _train_to_the_target_with_a_stop_arriving(session, state, stop, steps=3)
        returned = time.monotonic()
    finally:
        store.release.set()
        mirror.close()
        stop.close()
    assert session.target_reached is True
    # the upload had the stop's grace from its arrival; before the fix it waited on the store
    assert arrived + 1.0 - 0.1 <= returned <= arrived + 1.0 + 1.0, returned - arrived
    assert session.final_upload_landed is False
    assert session.exit_code == EXIT_FAILURE  # finished, but the final one is not mirrored
    local = FileStorage(tmp_path / "run")
    assert list_checkpoints(local) == [3]
    assert read_manifest(local, 3).extra["reason"] == "final"


def test_a_run_at_its_target_with_a_stop_pending_exits_0_once_its_final_one_is_mirrored(
    tmp_path: Path,
) -> None:
    bucket = FileStorage(tmp_path / "bucket")
    metrics = RunnerMetrics()
    mirror = Mirror(bucket, keep=2, writer_id="pod-a", metrics=metrics)
    cfg = config(tmp_path, mirror=False, steps=3, ckpt_every=100, grace_seconds=30.0)
    stop = StopController()
    try:
        services = Services(metrics=metrics, mirror=mirror)
        state = new_state()
        with TrainSession(cfg, state=state, stop=stop, services=services) as session:
            _train_to_the_target_with_a_stop_arriving(session, state, stop, steps=3)
    finally:
        mirror.close()
        stop.close()
    assert session.final_upload_landed is True
    assert session.exit_code == EXIT_OK  # at the target: 0, not 75
    assert list_checkpoints(bucket) == [3]
