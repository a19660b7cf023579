"""The supervisor follows a run re-based at a lower step (resumed at more ranks): real
CommitTracker objects over checkpoint dirs committed by the real writer, a real Mirror on a
file:// bucket that holds the older 1-rank lineage (steps 10, 15, 20 = 40, 60, 80 samples).

A lower-step checkpoint with more samples is the newest; once it is in the bucket the stale
higher steps are de-committed (manifest kept aside), never one with more samples. A lower-step
checkpoint with fewer samples is older: nothing is submitted nor de-committed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from runner.checkpoint.aside import set_aside_local
from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.manifest import FORMAT_SEED_BIN
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.errors import EXIT_PREEMPTED, StorageError
from runner.mirror import Mirror
from runner.storage.file import FileStorage
from runner.supervisor.tracking import CommitTracker

OLD = {10: 40, 15: 60, 20: 80}  # the 1-rank lineage: step -> samples_seen


def _commit(run_dir: Path, step: int, samples: int, world_size: int) -> CommittedCheckpoint:
    payload = hashlib.sha256(f"{step}-{samples}-{world_size}".encode()).digest() * 64
    src = run_dir / f"src-{step}-{samples}"
    src.mkdir(parents=True)
    (src / "weights.bin").write_bytes(payload)
    meta = CheckpointMeta(
        step=step,
        samples_seen=samples,
        world_size=world_size,
        epoch=0,
        batch_in_epoch=step,
        fingerprint=hashlib.sha256(payload).hexdigest(),
    )
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="run-1", writer_id="pod-a")
    return writer.adopt_files(
        {"weights.bin": src / "weights.bin"}, meta=meta, format=FORMAT_SEED_BIN
    )


def _setup(tmp_path: Path) -> tuple[Path, FileStorage, Mirror, CommitTracker]:
    """The bucket holds the old lineage; the run dir its step 20, resumed from."""
    bucket = FileStorage(tmp_path / "bucket")
    mirror = Mirror(bucket, keep=10, writer_id="sup")
    old = tmp_path / "old"
    for step, samples in OLD.items():
        assert mirror.upload_now(_commit(old, step, samples, 1))
    run_dir = tmp_path / "run"
    resumed = _commit(run_dir, 20, 80, 1)
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="run-1", writer_id="sup")
    tracker = CommitTracker(run_dir, writer=writer, keep=10, mirror=mirror, metrics=None)
    tracker.seen(resumed)
    return run_dir, bucket, mirror, tracker


def _bucket(bucket: FileStorage) -> dict[int, tuple[int, int]]:
    """step -> (samples_seen, world_size) of every committed checkpoint there."""
    out = {}
    for step in list_checkpoints(bucket):
        m = read_manifest(bucket, step)
        out[step] = (m.samples_seen, m.world_size)
    return out


def _aside(bucket: FileStorage) -> list[str]:
    return sorted(i.key.split("/")[1].split("-")[0] for i in bucket.list("aside/"))


def _rebase_locally(run_dir: Path) -> None:
    """What runner/session/rebase.py does without a mirror: the resumed step set aside, the
    loaded state committed at the rescaled step 10 (same 80 samples, 2 ranks)."""
    set_aside_local(run_dir, run_dir / "checkpoints" / "step_000020", reason="superseded")
    _commit(run_dir, 10, 80, 2)


def test_lower_step_more_samples_is_newest_and_stale_steps_are_decommitted_once_it_landed(
    tmp_path: Path,
) -> None:
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    _rebase_locally(run_dir)
    _commit(run_dir, 15, 120, 2)
    tracker.follow_committed(stopping=False)
    assert tracker.last_checkpoint is not None and tracker.last_checkpoint.step == 15
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)  # landed: the stale step 20 goes
    # old 15 made room for new 15 (old 20 still held its state), then old 20 (80 <= 120)
    assert _bucket(bucket) == {10: (40, 1), 15: (120, 2)}
    assert _aside(bucket) == ["step_000015", "step_000020"]
    _commit(run_dir, 20, 160, 2)
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    assert _bucket(bucket) == {10: (40, 1), 15: (120, 2), 20: (160, 2)}
    assert _aside(bucket) == ["step_000015", "step_000020"]


def test_lower_step_fewer_samples_is_older_nothing_decommitted(tmp_path: Path) -> None:
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    _commit(run_dir, 15, 50, 2)  # lower step, fewer samples than the resumed 80
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)
    assert tracker.last_checkpoint is not None and tracker.last_checkpoint.step == 20
    assert _bucket(bucket) == {10: (40, 1), 15: (60, 1), 20: (80, 1)}
    assert _aside(bucket) == []


def test_a_stop_final_at_a_lower_step_with_more_samples_is_fresh_and_the_buckets_newest(
    tmp_path: Path,
) -> None:
    """Stopped before any background upload: the final upload de-commits what is in its way."""
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    tracker.record_step_at_stop()
    assert (tracker.step_at_stop, tracker.samples_at_stop) == (20, 80)
    _rebase_locally(run_dir)
    _commit(run_dir, 15, 120, 2)
    tracker.follow_committed(stopping=True)  # nothing submitted during a stop
    judged = tracker.judge_stop(code=EXIT_PREEMPTED, killed=False)
    assert judged.ckpt is not None and judged.ckpt.step == 15
    assert judged.fresh and judged.final
    assert _bucket(bucket) == {10: (40, 1), 15: (60, 1), 20: (80, 1)}
    with tracker.final_upload(judged.ckpt, deadline=None):
        assert mirror.upload_now(judged.ckpt)
    assert _bucket(bucket) == {10: (40, 1), 15: (120, 2)}
    assert max(_bucket(bucket)) == 15


def test_a_lower_step_with_the_same_samples_is_not_fresh_while_the_resumed_dir_stands(
    tmp_path: Path,
) -> None:
    """Same samples: the larger step is newer, unless the trainer set its directory aside."""
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    _commit(run_dir, 10, 80, 2)
    tracker.follow_committed(stopping=False)
    assert tracker.last_checkpoint is not None and tracker.last_checkpoint.step == 20
    set_aside_local(run_dir, run_dir / "checkpoints" / "step_000020", reason="superseded")
    tracker.follow_committed(stopping=False)
    assert tracker.last_checkpoint.step == 10
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)
    assert _bucket(bucket) == {10: (80, 2)}
    assert _aside(bucket) == ["step_000010", "step_000015", "step_000020"]


class FakeFailingPutsStorage(FileStorage):
    """A file:// bucket whose file uploads fail while `failing` (a store that is down)."""

    failing = False

    def put_file(self, key: str, src: Path, **kw: Any) -> None:  # type: ignore[override]
        if self.failing:
            raise StorageError(f"{self.uri}/{key}: injected upload failure")
        super().put_file(key, src, **kw)


def test_fake_failing_store_a_rebase_upload_that_fails_leaves_the_bucket_as_it_is(
    tmp_path: Path,
) -> None:
    """The candidate's step is free in the bucket: nothing is de-committed before it lands,
    and nothing after a failed upload; once the store is back it lands and the stale go."""
    bucket = FakeFailingPutsStorage(tmp_path / "bucket")
    mirror = Mirror(bucket, keep=10, writer_id="sup")
    for step, samples in OLD.items():
        assert mirror.upload_now(_commit(tmp_path / "old", step, samples, 1))
    run_dir = tmp_path / "run"
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="run-1", writer_id="sup")
    tracker = CommitTracker(run_dir, writer=writer, keep=10, mirror=mirror, metrics=None)
    tracker.seen(_commit(run_dir, 20, 80, 1))
    _rebase_locally(run_dir)
    _commit(run_dir, 12, 96, 2)
    bucket.failing = True
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)  # idle, not landed: left as it is
    assert tracker.last_checkpoint is not None and tracker.last_checkpoint.step == 12
    assert _bucket(bucket) == {10: (40, 1), 15: (60, 1), 20: (80, 1)}
    assert _aside(bucket) == []
    bucket.failing = False
    _commit(run_dir, 14, 112, 2)  # the next checkpoint: the candidate now, submitted again
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)
    assert _bucket(bucket) == {10: (40, 1), 14: (112, 2)}
    assert _aside(bucket) == ["step_000015", "step_000020"]
