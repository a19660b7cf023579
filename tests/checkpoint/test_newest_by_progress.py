"""Every walk orders checkpoints by one rule: newest by progress (samples seen, then step).

The crash window of a re-base: a 1-rank run saved steps 40 and 50 (160 and 200 samples), was
resumed from 50 at 2 ranks, re-based to step 25 (the same 200 samples) and saved step 30 (240
samples), then died before the older lineage was set aside. Step 30 holds the newest work,
though 40 and 50 carry higher numbers: resume (local and from the mirror), the bucket walk of
several nodes, the supervisor's last commit, retention, `runner ls` and verify all take 30
first. Real writer commits in real directories, a real file:// mirror, the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runner.checkpoint.layout import step_dir_name
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.manifest import FORMAT_SEED_BIN, Manifest
from runner.checkpoint.newest import newest_first, read_manifests, steps_newest_first
from runner.checkpoint.retention import prune
from runner.checkpoint.verify import iter_checked, verify_checkpoint
from runner.checkpoint.writer import CommittedCheckpoint
from runner.mirror.node_resume import newest_in_bucket
from runner.mirror.resume import choose_resume
from runner.mirror.upload import upload_checkpoint
from runner.storage.file import FileStorage
from runner.supervisor.ending import newest_committed
from tests.fixtures.ckpt import commit_counted

# step -> (samples_seen, world_size): the older lineage, then the re-based one
WINDOW = {40: (160, 1), 50: (200, 1), 25: (200, 2), 30: (240, 2)}
ORDER = [30, 50, 25, 40]


def _window(run_dir: Path) -> dict[int, CommittedCheckpoint]:
    return {step: commit_counted(run_dir, step, s, w) for step, (s, w) in WINDOW.items()}


def _bucket_of(tmp_path: Path) -> FileStorage:
    committed = _window(tmp_path / "source")
    bucket = FileStorage(tmp_path / "bucket")
    for ckpt in committed.values():
        upload_checkpoint(bucket, ckpt.path)
    return bucket


def _manifest(step: int, samples: int) -> Manifest:
    return Manifest(
        schema="3", step=step, samples_seen=samples, run_id="r", writer="w",
        format=FORMAT_SEED_BIN, fingerprint="",
    )  # fmt: skip


def test_local_resume_takes_the_rebased_lineage_newest_work(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _window(run_dir)
    point = choose_resume(run_dir, None)
    assert point is not None
    assert (point.step, point.manifest.samples_seen, point.manifest.world_size) == (30, 240, 2)
    assert not point.from_mirror and point.refused == ()


def test_fresh_node_downloads_the_newest_work_from_the_mirror(tmp_path: Path) -> None:
    bucket = _bucket_of(tmp_path)
    run_dir = tmp_path / "fresh-node"
    point = choose_resume(run_dir, bucket)
    assert point is not None and point.from_mirror
    assert (point.step, point.manifest.samples_seen) == (30, 240)
    # only the chosen one came down: nothing older was read
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [step_dir_name(30)]


def test_the_ranks_of_several_nodes_pick_the_newest_work_in_the_bucket(tmp_path: Path) -> None:
    manifest = newest_in_bucket(_bucket_of(tmp_path))
    assert manifest is not None and (manifest.step, manifest.samples_seen) == (30, 240)


def test_the_supervisor_takes_the_newest_work_as_the_last_commit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _window(run_dir)
    last = newest_committed(run_dir / "checkpoints")
    assert last is not None and last.step == 30


def test_retention_keeps_the_newest_work_and_prunes_by_progress(tmp_path: Path) -> None:
    bucket = _bucket_of(tmp_path)
    assert prune(bucket, keep=2) == [25, 40]
    assert list_checkpoints(bucket) == [30, 50]
    run_dir = tmp_path / "run"
    _window(run_dir)
    assert prune(FileStorage(run_dir), keep=3) == [40]


def test_ls_and_verify_walk_newest_first_by_progress(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _window(run_dir)
    storage = FileStorage(run_dir)
    assert steps_newest_first(storage) == ORDER
    assert [v.step for v in iter_checked(storage, verify_checkpoint)] == ORDER
    listed = subprocess.run(
        [sys.executable, "-m", "runner", "ls", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [row["step"] for row in rows] == ORDER


def test_without_counters_the_order_is_by_step() -> None:
    # adopted seed files carry samples_seen 0: no progress to compare, so all go by step
    manifests = {10: _manifest(10, 500), 20: _manifest(20, 0), 15: _manifest(15, 900)}
    assert newest_first(manifests) == [20, 15, 10]
    assert newest_first({10: _manifest(10, 500), 20: _manifest(20, 100)}) == [10, 20]


def test_an_unreadable_manifest_takes_its_place_by_step() -> None:
    # 45 and 60 cannot be read: each goes before the first readable step numbered below it
    manifests: dict[int, Manifest | None] = {
        40: _manifest(40, 160), 50: _manifest(50, 200), 25: _manifest(25, 200),
        30: _manifest(30, 240), 45: None, 60: None,
    }  # fmt: skip
    assert newest_first(manifests) == [60, 45, 30, 50, 25, 40]
    assert newest_first({7: None, 3: None}) == [7, 3]


def test_read_manifests_marks_an_unreadable_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _window(run_dir)
    (run_dir / "checkpoints" / step_dir_name(40) / "manifest.json").write_text("{ not json")
    storage = FileStorage(run_dir)
    read = read_manifests(storage, list_checkpoints(storage))
    assert read[40] is None and {s for s, m in read.items() if m is not None} == {25, 30, 50}
