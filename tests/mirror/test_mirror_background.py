"""Mirror scheduling at shutdown, with a fake slow store (a real store will not hang on
demand): the grace period belongs to the final checkpoint, not to an overtaken one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from runner.checkpoint.listing import list_checkpoints
from runner.mirror import Mirror
from runner.storage.base import ProgressCallback
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import make_checkpoint


class FakeSlowStore(FileStorage):
    """A file:// store whose uploads under one step hang until released."""

    def __init__(self, root: Path, *, hang_on: str) -> None:
        super().__init__(root)
        self.hang_on = hang_on
        self.release = threading.Event()
        self.hanging = threading.Event()

    def put_file(
        self,
        key: str,
        src: Path,
        *,
        sha256: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        if self.hang_on in key:
            self.hanging.set()
            self.release.wait(30)
        super().put_file(key, src, sha256=sha256, progress=progress)


def test_fake_slow_store_close_does_not_wait_for_an_overtaken_upload(tmp_path: Path) -> None:
    store = FakeSlowStore(tmp_path / "bucket", hang_on="step_000010/")
    mirror = Mirror(store, keep=2, writer_id="pod-a")
    run = tmp_path / "run"
    try:
        mirror.submit(make_checkpoint(run, 10))
        assert store.hanging.wait(10)
        assert mirror.in_flight_steps() == {10}  # local retention must keep it

        assert mirror.upload_now(make_checkpoint(run, 20), deadline=time.monotonic() + 30)
        started = time.monotonic()
        mirror.close(timeout=20)
        assert time.monotonic() - started < 2.0
        assert mirror.last_uploaded == 20
        assert list_checkpoints(store) == [20]
    finally:
        store.release.set()


def test_fake_slow_store_final_upload_past_its_deadline_is_reported(tmp_path: Path) -> None:
    store = FakeSlowStore(tmp_path / "bucket", hang_on="step_000030/")
    mirror = Mirror(store, keep=2, writer_id="pod-a")
    try:
        started = time.monotonic()
        landed = mirror.upload_now(
            make_checkpoint(tmp_path / "run", 30), deadline=time.monotonic() + 0.5
        )
        assert landed is False
        assert 0.5 <= time.monotonic() - started < 2.0
        assert mirror.in_flight_steps() == {30}
        assert mirror.last_error == "step 30: deadline passed"
    finally:
        store.release.set()
        mirror.close(timeout=10)
