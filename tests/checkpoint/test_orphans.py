"""Orphan sweep: objects no manifest names go once they are old enough; nothing a manifest
names, nothing of a step that may be uploading right now, nothing younger than the limit."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.orphans import find_orphans, sweep_orphans
from runner.checkpoint.verify import verify_checkpoint
from runner.mirror import Mirror, upload_checkpoint
from runner.storage import Storage, open_storage
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.cli_process import runner

LOST_RACE = "checkpoints/step_000010/up-dead-pod-0123456789/weights.bin"
KILLED_UPLOAD = "checkpoints/step_000015/up-dead-pod-abcdef0123/weights.bin"
IN_FLIGHT = "checkpoints/step_000030/up-live-pod-fedcba9876/weights.bin"


def seed_debris(storage: Storage, run: Path) -> None:
    for step in (10, 20):
        upload_checkpoint(storage, make_checkpoint(run, step).path)
    for key in (LOST_RACE, KILLED_UPLOAD, IN_FLIGHT):
        storage.put_bytes(key, b"x" * 1000)


@pytest.mark.slow
def test_sweep_deletes_only_old_objects_no_manifest_names(
    any_storage: Storage, tmp_path: Path
) -> None:
    seed_debris(any_storage, tmp_path / "run")
    # just written: younger than an hour, so nothing is a candidate yet
    assert find_orphans(any_storage, older_than_s=3600) == []
    later = time.time() + 5
    found = find_orphans(any_storage, older_than_s=0, now=later)
    assert sorted(info.key for info in found) == [LOST_RACE, KILLED_UPLOAD]
    assert [info.size for info in found] == [1000, 1000]
    assert find_orphans(any_storage, older_than_s=0, now=later, protect={10, 15}) == []

    time.sleep(1.1)  # object stores date objects to the second
    sweep = sweep_orphans(any_storage, older_than_s=0)
    assert sorted(info.key for info in sweep.deleted) == [LOST_RACE, KILLED_UPLOAD]
    assert sweep.bytes == 2000
    keys = {info.key for info in any_storage.list("checkpoints/")}
    assert IN_FLIGHT in keys and LOST_RACE not in keys and KILLED_UPLOAD not in keys
    assert list_checkpoints(any_storage) == [10, 20]
    for step in (10, 20):
        verify_checkpoint(any_storage, step)


def test_a_step_whose_manifest_cannot_be_read_is_left_alone(
    any_storage: Storage, tmp_path: Path
) -> None:
    seed_debris(any_storage, tmp_path / "run")
    any_storage.delete("checkpoints/step_000010/manifest.json")
    any_storage.put_bytes("checkpoints/step_000010/manifest.json", b"{not json")
    found = find_orphans(any_storage, older_than_s=0, now=time.time() + 5)
    assert [info.key for info in found] == [KILLED_UPLOAD]


def test_prune_cli_sweeps_orphans_older_than_the_limit(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    location = f"file://{bucket}"
    seed_debris(open_storage(location), tmp_path / "run")
    old = time.time() - 3 * 3600
    os.utime(bucket / KILLED_UPLOAD, (old, old))
    result = runner("prune", location, "--keep", "2", "--orphan-age-hours", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "deleted": [],
        "orphans_deleted": [KILLED_UPLOAD],
        "orphan_bytes": 1000,
        "aside_kept": [],
        "aside_kept_bytes": 0,
    }
    assert not (bucket / KILLED_UPLOAD).parent.parent.exists()  # empty dirs go too
    assert (bucket / LOST_RACE).exists() and (bucket / IN_FLIGHT).exists()
    text = runner("prune", location, "--keep", "2", "--orphan-age-hours", "0")
    assert text.returncode == 0, text.stderr
    assert text.stdout.strip() == "deleted 1 orphan object (1000 B) that no manifest names"


def test_the_mirror_sweeps_day_old_debris_after_an_upload(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    storage = open_storage(f"file://{bucket}")
    seed_debris(storage, tmp_path / "run")
    day_ago = time.time() - 24 * 3600 - 60
    os.utime(bucket / KILLED_UPLOAD, (day_ago, day_ago))
    mirror = Mirror(storage, keep=5, writer_id="pod-b")
    try:
        mirror.submit(make_checkpoint(tmp_path / "run", 40))
        assert mirror.wait_idle(timeout=60)
    finally:
        mirror.close()
    assert not (bucket / KILLED_UPLOAD).exists()
    assert (bucket / LOST_RACE).exists()  # an hour old at most: kept
    assert (bucket / IN_FLIGHT).exists()  # below 40 now, but just written
    assert list_checkpoints(storage) == [10, 20, 40]
