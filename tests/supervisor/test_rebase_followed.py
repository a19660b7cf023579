"""The supervisor follows a run re-based at a lower step (resumed at more ranks): real
CommitTracker objects over checkpoint dirs committed by the real writer, a real Mirror on a
file:// bucket that holds the older 1-rank lineage (steps 10, 15, 20 = 40, 60, 80 samples).

A lower-step checkpoint with more samples is the newest. The trainer's re-based checkpoint
(step 10, the resumed state renumbered) goes to the bucket first: before it, the older lineage
from step 10 up is de-committed (manifest kept aside) except its newest, which holds the state
until the re-based one is in; then that one goes too, never one with more samples, and newer
checkpoints follow. A lower-step checkpoint with fewer samples is older: nothing is submitted
nor de-committed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from runner.checkpoint.aside import set_aside_local
from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.writer import CheckpointWriter
from runner.errors import EXIT_FAILURE, EXIT_PREEMPTED, StorageError
from runner.mirror import Mirror
from runner.storage.file import FileStorage
from runner.supervisor.tracking import CommitTracker
from tests.fixtures.ckpt import commit_counted

OLD = {10: 40, 15: 60, 20: 80}  # the 1-rank lineage: step -> samples_seen


def _setup(tmp_path: Path) -> tuple[Path, FileStorage, Mirror, CommitTracker]:
    """The bucket holds the old lineage; the run dir its step 20, resumed from."""
    bucket = FileStorage(tmp_path / "bucket")
    mirror = Mirror(bucket, keep=10, writer_id="sup")
    old = tmp_path / "old"
    for step, samples in OLD.items():
        assert mirror.upload_now(commit_counted(old, step, samples, 1))
    run_dir = tmp_path / "run"
    resumed = commit_counted(run_dir, 20, 80, 1)
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
    commit_counted(run_dir, 10, 80, 2)


def test_lower_step_more_samples_is_newest_and_stale_steps_are_decommitted_once_it_landed(
    tmp_path: Path,
) -> None:
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    _rebase_locally(run_dir)
    commit_counted(run_dir, 15, 120, 2)
    tracker.follow_committed(stopping=False)
    assert tracker.last_checkpoint is not None and tracker.last_checkpoint.step == 15
    assert mirror.wait_idle(30)
    # the re-based step 10 went first, not the newest: old 10 and 15 made room for it
    # (old 20 held their state); the newest waits, since its number may be a stale one's
    assert _bucket(bucket) == {10: (80, 2), 20: (80, 1)}
    assert _aside(bucket) == ["step_000010", "step_000015"]
    tracker.follow_committed(stopping=False)  # landed: the stale step 20 goes, 15 follows
    assert mirror.wait_idle(30)
    assert _bucket(bucket) == {10: (80, 2), 15: (120, 2)}
    assert _aside(bucket) == ["step_000010", "step_000015", "step_000020"]
    assert tracker.unless_rebase_unfinished(EXIT_PREEMPTED) == EXIT_PREEMPTED
    commit_counted(run_dir, 20, 160, 2)
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    assert _bucket(bucket) == {10: (80, 2), 15: (120, 2), 20: (160, 2)}
    assert _aside(bucket) == ["step_000010", "step_000015", "step_000020"]


def test_lower_step_fewer_samples_is_older_nothing_decommitted(tmp_path: Path) -> None:
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    commit_counted(run_dir, 15, 50, 2)  # lower step, fewer samples than the resumed 80
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)
    assert tracker.last_checkpoint is not None and tracker.last_checkpoint.step == 20
    assert _bucket(bucket) == {10: (40, 1), 15: (60, 1), 20: (80, 1)}
    assert _aside(bucket) == []


def test_a_stop_final_at_a_lower_step_with_more_samples_is_fresh_and_the_buckets_newest(
    tmp_path: Path,
) -> None:
    """Stopped before any background upload: the re-based step goes first, then the final."""
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    tracker.record_step_at_stop()
    assert (tracker.step_at_stop, tracker.samples_at_stop) == (20, 80)
    _rebase_locally(run_dir)
    commit_counted(run_dir, 15, 120, 2)
    tracker.follow_committed(stopping=True)  # nothing submitted during a stop
    judged = tracker.judge_stop(code=EXIT_PREEMPTED, killed=False)
    assert judged.ckpt is not None and judged.ckpt.step == 15
    assert judged.fresh and judged.final
    assert _bucket(bucket) == {10: (40, 1), 15: (60, 1), 20: (80, 1)}
    with tracker.final_upload(judged.ckpt, deadline=None):
        assert _bucket(bucket) == {10: (80, 2)}  # in, and the stale steps gone, before it
        assert mirror.upload_now(judged.ckpt)
    assert _bucket(bucket) == {10: (80, 2), 15: (120, 2)}
    assert _aside(bucket) == ["step_000010", "step_000015", "step_000020"]
    assert tracker.unless_rebase_unfinished(EXIT_PREEMPTED) == EXIT_PREEMPTED


def test_a_lower_step_with_the_same_samples_is_not_fresh_while_the_resumed_dir_stands(
    tmp_path: Path,
) -> None:
    """Same samples: the larger step is newer, unless the trainer set its directory aside."""
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    commit_counted(run_dir, 10, 80, 2)
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

    def put_file(self, key: str, src: Path, **kw: Any) -> None:
        if self.failing:
            raise StorageError(f"{self.uri}/{key}: injected upload failure")
        super().put_file(key, src, **kw)


def _failing_setup(tmp_path: Path) -> tuple[Path, FakeFailingPutsStorage, Mirror, CommitTracker]:
    bucket = FakeFailingPutsStorage(tmp_path / "bucket")
    mirror = Mirror(bucket, keep=10, writer_id="sup")
    for step, samples in OLD.items():
        assert mirror.upload_now(commit_counted(tmp_path / "old", step, samples, 1))
    run_dir = tmp_path / "run"
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="run-1", writer_id="sup")
    tracker = CommitTracker(run_dir, writer=writer, keep=10, mirror=mirror, metrics=None)
    tracker.seen(commit_counted(run_dir, 20, 80, 1))
    return run_dir, bucket, mirror, tracker


def test_fake_failing_store_a_rebase_upload_that_fails_leaves_the_newest_state_committed(
    tmp_path: Path,
) -> None:
    """Before the re-based step lands only what the old newest step holds is de-committed,
    and nothing after a failed upload; once the store is back the re-based step goes again
    (not the newest), then the stale step, then the newest."""
    run_dir, bucket, mirror, tracker = _failing_setup(tmp_path)
    _rebase_locally(run_dir)
    commit_counted(run_dir, 12, 96, 2)
    bucket.failing = True
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)  # idle, not landed: left as it is
    assert tracker.last_checkpoint is not None and tracker.last_checkpoint.step == 12
    assert _bucket(bucket) == {20: (80, 1)}  # the state the re-based step holds, still there
    assert _aside(bucket) == ["step_000010", "step_000015"]
    bucket.failing = False
    commit_counted(run_dir, 14, 112, 2)  # the next checkpoint: the re-based step submitted again
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    assert _bucket(bucket) == {10: (80, 2), 14: (112, 2)}
    assert _aside(bucket) == ["step_000010", "step_000015", "step_000020"]


def test_fake_failing_store_a_stop_uploads_the_rebased_step_before_the_final_one(
    tmp_path: Path,
) -> None:
    """The re-based step's upload failed in the background and the stop came: the final
    upload puts it in first, then the stale step goes, then the final one: 75 stands."""
    run_dir, bucket, mirror, tracker = _failing_setup(tmp_path)
    _rebase_locally(run_dir)
    bucket.failing = True
    tracker.follow_committed(stopping=False)
    assert mirror.wait_idle(30)
    tracker.record_step_at_stop()
    commit_counted(run_dir, 16, 128, 2)  # the final checkpoint
    tracker.follow_committed(stopping=True)
    judged = tracker.judge_stop(code=EXIT_PREEMPTED, killed=False)
    assert judged.ckpt is not None and judged.ckpt.step == 16 and judged.final
    bucket.failing = False
    with tracker.final_upload(judged.ckpt, deadline=None):
        assert _bucket(bucket) == {10: (80, 2)}
        assert mirror.upload_now(judged.ckpt)
    assert _bucket(bucket) == {10: (80, 2), 16: (128, 2)}
    assert tracker.unless_rebase_unfinished(EXIT_PREEMPTED) == EXIT_PREEMPTED


class FakeRefusingStepStorage(FileStorage):
    """A file:// bucket that refuses every file of one step (`refused`): a partial outage."""

    refused: str | None = None

    def put_file(self, key: str, src: Path, **kw: Any) -> None:
        if self.refused is not None and key.startswith(self.refused):
            raise StorageError(f"{self.uri}/{key}: injected upload failure")
        super().put_file(key, src, **kw)


def test_fake_refusing_store_a_stop_whose_rebased_step_never_lands_exits_1(
    tmp_path: Path,
) -> None:
    """The re-based step cannot be uploaded at all: the final one still goes (the newest
    state is durable) and, holding more samples, de-commits the stale steps above the re-based
    one; but the re-based step is in no version of the bucket, so the attempt exits 1, not 75."""
    bucket = FakeRefusingStepStorage(tmp_path / "bucket")
    mirror = Mirror(bucket, keep=10, writer_id="sup")
    for step, samples in OLD.items():
        assert mirror.upload_now(commit_counted(tmp_path / "old", step, samples, 1))
    run_dir = tmp_path / "run"
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="run-1", writer_id="sup")
    tracker = CommitTracker(run_dir, writer=writer, keep=10, mirror=mirror, metrics=None)
    tracker.seen(commit_counted(run_dir, 20, 80, 1))
    bucket.refused = "checkpoints/step_000010/"
    tracker.record_step_at_stop()
    _rebase_locally(run_dir)
    commit_counted(run_dir, 16, 128, 2)
    tracker.follow_committed(stopping=True)
    judged = tracker.judge_stop(code=EXIT_PREEMPTED, killed=False)
    assert judged.ckpt is not None and judged.ckpt.step == 16
    with tracker.final_upload(judged.ckpt, deadline=None):
        assert _bucket(bucket) == {20: (80, 1)}  # it did not land: old 20 holds the state
        assert mirror.upload_now(judged.ckpt)
    assert _bucket(bucket) == {16: (128, 2)}
    assert _aside(bucket) == ["step_000010", "step_000015", "step_000020"]
    assert tracker.unless_rebase_unfinished(EXIT_PREEMPTED) == EXIT_FAILURE


def test_a_rebased_step_the_trainer_pruned_gives_way_to_a_newer_one_not_numbered_like_a_stale_one(
    tmp_path: Path,
) -> None:
    """The trainer's retention removed the re-based step before it reached the bucket, and
    the final checkpoint is numbered like the older lineage's newest (20), which holds the
    state until something newer is in: the newest checkpoint with a free number (15) lands
    first, then old 20 goes and the final 20 lands. Nothing is left to re-base: 75 stands."""
    run_dir, bucket, mirror, tracker = _setup(tmp_path)
    tracker.record_step_at_stop()
    _rebase_locally(run_dir)
    commit_counted(run_dir, 15, 120, 2)
    commit_counted(run_dir, 20, 160, 2)  # the final checkpoint
    tracker.follow_committed(stopping=True)
    shutil.rmtree(run_dir / "checkpoints" / "step_000010")  # the trainer's --keep
    judged = tracker.judge_stop(code=EXIT_PREEMPTED, killed=False)
    assert judged.ckpt is not None and judged.ckpt.step == 20 and judged.final
    with tracker.final_upload(judged.ckpt, deadline=None):
        assert _bucket(bucket) == {15: (120, 2)}
        assert mirror.upload_now(judged.ckpt)
    assert _bucket(bucket) == {15: (120, 2), 20: (160, 2)}
    assert _aside(bucket) == ["step_000010", "step_000015", "step_000020"]
    assert tracker.unless_rebase_unfinished(EXIT_PREEMPTED) == EXIT_PREEMPTED
