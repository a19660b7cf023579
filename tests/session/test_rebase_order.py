"""The in-process re-base (runner/session/rebase.py) in the mirror: real checkpoint dirs from
the real writer, a real Mirror on a file:// bucket holding the older 1-rank lineage (steps 10,
15, 20 = 40, 60, 80 samples), resumed from step 20 and re-based at step 10 (80 samples, 2 ranks).

The order (runner/mirror/superseded.py): the older steps from 10 up are de-committed before the
re-based one is uploaded, all but the newest (20, which holds the state until then); step 20
only after. A de-commit that fails after the upload ends the re-base before training (exit 1),
with the resumed step still in the run dir, so the next attempt re-bases again."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.checkpoint.layout import MANIFEST_NAME
from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import StorageError
from runner.mirror import Mirror
from runner.session.rebase import RebaseIncomplete, rebase
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import commit_counted

OLD = {10: 40, 15: 60, 20: 80}


class FakeRecordingStorage(FileStorage):
    """A file:// bucket that records every manifest written or deleted, in order, and can
    refuse to delete the manifest of one step (`stuck`): a store failing mid-re-base."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.events: list[str] = []
        self.stuck: int | None = None

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        super().put_bytes(key, data, if_absent=if_absent)
        if key.endswith(f"/{MANIFEST_NAME}"):
            self.events.append(f"put {key.split('/')[1]}")

    def delete(self, key: str) -> None:
        if self.stuck is not None and key == f"checkpoints/step_{self.stuck:06d}/{MANIFEST_NAME}":
            raise StorageError(f"{self.uri}/{key}: injected delete failure")
        super().delete(key)
        if key.endswith(f"/{MANIFEST_NAME}"):
            self.events.append(f"delete {key.split('/')[1]}")


def _setup(tmp_path: Path) -> tuple[Path, FakeRecordingStorage, Mirror]:
    """The bucket and the run dir both hold the older lineage, resumed from step 20."""
    bucket = FakeRecordingStorage(tmp_path / "bucket")
    mirror = Mirror(bucket, keep=10, writer_id="rank0")
    run_dir = tmp_path / "run"
    for step, samples in OLD.items():
        assert mirror.upload_now(commit_counted(run_dir, step, samples, 1, writer="rank0"))
    bucket.events.clear()
    return run_dir, bucket, mirror


def _rebase(run_dir: Path, mirror: Mirror) -> CommittedCheckpoint:
    return rebase(
        new_step=10,
        resumed_step=20,
        run_dir=run_dir,
        ckpt_dir=run_dir / "checkpoints",
        primary=True,
        save=lambda: commit_counted(run_dir, 10, 80, 2, writer="rank0"),
        mirror=mirror,
    )


def _bucket(bucket: FileStorage) -> dict[int, tuple[int, int]]:
    return {
        s: (read_manifest(bucket, s).samples_seen, read_manifest(bucket, s).world_size)
        for s in list_checkpoints(bucket)
    }


def test_fake_recording_store_older_steps_go_before_the_upload_the_resumed_one_after(
    tmp_path: Path,
) -> None:
    run_dir, bucket, mirror = _setup(tmp_path)
    _rebase(run_dir, mirror)
    assert bucket.events == [
        "delete step_000010",
        "delete step_000015",
        "put step_000010",
        "delete step_000020",
    ]
    assert _bucket(bucket) == {10: (80, 2)}
    aside = sorted(i.key.split("/")[1].split("-")[0] for i in bucket.list("aside/"))
    assert aside == ["step_000010", "step_000015", "step_000020"]
    assert list_checkpoints(FileStorage(run_dir)) == [10]


def test_fake_recording_store_a_resumed_step_left_committed_stops_before_training(
    tmp_path: Path,
) -> None:
    run_dir, bucket, mirror = _setup(tmp_path)
    bucket.stuck = 20
    with pytest.raises(RebaseIncomplete, match="could not be de-committed"):
        _rebase(run_dir, mirror)
    # the re-based step is in, the older state beside it: the next start resumes step 20
    # (the run dir still holds it) and re-bases again
    assert _bucket(bucket) == {10: (80, 2), 20: (80, 1)}
    assert list_checkpoints(FileStorage(run_dir)) == [10, 20]
    bucket.stuck = None
    _rebase(run_dir, mirror)
    assert _bucket(bucket) == {10: (80, 2)}
    assert list_checkpoints(FileStorage(run_dir)) == [10]
