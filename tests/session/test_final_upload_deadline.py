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

from runner.mirror import Mirror
from runner.storage.s3 import S3Storage
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.fake_store import FakeStore, env_for

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
