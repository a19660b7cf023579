"""Nothing set aside is deleted: the objects a de-committed checkpoint's aside record names
survive retention, the orphan sweep and `runner repair` unless the record says `corrupt`.

Two lineages write the same step numbers, as after a re-base (a resume at more ranks) or a
`--fresh-start`: the old one's step is de-committed (its manifest copied to aside/), the new
one commits that step again in its own upload attempt, then prunes it. Against a file://
bucket and a real SeaweedFS bucket; every object is checked by size and sha256."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from runner.checkpoint.aside import CORRUPT, FOREIGN, decommit_remote
from runner.checkpoint.layout import manifest_key
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.orphans import sweep_orphans
from runner.checkpoint.retention import prune
from runner.checkpoint.verify import verify_checkpoint
from runner.mirror import upload_checkpoint
from runner.storage.base import Storage
from tests.fixtures.aside_records import aside_records, keys_under, missing_or_changed
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.cli_process import runner

SUPERSEDED = "superseded-by-rescale"  # what both re-base paths name their records


def step_prefix(step: int) -> str:
    return f"checkpoints/step_{step:06d}/"


def lineage(
    storage: Storage, run: Path, steps: tuple[int, ...], *, seed: int
) -> dict[int, set[str]]:
    """Upload one lineage's checkpoints; step -> the payload keys its upload wrote."""
    wrote = {}
    for step in steps:
        before = keys_under(storage, step_prefix(step))
        upload_checkpoint(storage, make_checkpoint(run, step, seed=seed).path)
        wrote[step] = keys_under(storage, step_prefix(step)) - before - {manifest_key(step)}
    return wrote


def set_aside(storage: Storage, steps: tuple[int, ...], reason: str) -> None:
    for step in steps:
        assert decommit_remote(storage, step, reason=reason) is not None


def flip_byte(storage: Storage, key: str, tmp: Path) -> None:
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    tmp.write_bytes(bytes(data))
    storage.put_file(key, tmp)


@pytest.mark.slow
def test_a_superseded_record_keeps_its_objects_through_retention_and_the_sweep(
    any_storage: Storage, tmp_path: Path
) -> None:
    storage = any_storage
    old = lineage(storage, tmp_path / "old", (50, 52), seed=1)
    set_aside(storage, (50, 52), SUPERSEDED)  # what a re-base does to the older lineage
    new = lineage(storage, tmp_path / "new", (50, 60, 70), seed=2)

    assert prune(storage, keep=2) == [50]
    records = aside_records(storage)
    assert [(r.step, r.reason) for r in records] == [(50, SUPERSEDED), (52, SUPERSEDED)]
    assert [set(r.files) for r in records] == [old[50], old[52]]
    assert [missing_or_changed(storage, r) for r in records] == [[], []]
    # the new lineage's step 50 is gone; the old one's payload is all that is left there
    assert keys_under(storage, step_prefix(50)) == old[50]
    assert list_checkpoints(storage) == [60, 70]

    time.sleep(1.1)  # object stores date objects to the second
    assert sweep_orphans(storage, older_than_s=0).deleted == []
    assert [missing_or_changed(storage, r) for r in aside_records(storage)] == [[], []]
    assert keys_under(storage, "checkpoints/") == (
        old[50] | old[52] | new[60] | new[70] | {manifest_key(60), manifest_key(70)}
    )


@pytest.mark.slow
def test_a_corrupt_record_protects_nothing(any_storage: Storage, tmp_path: Path) -> None:
    storage = any_storage
    old = lineage(storage, tmp_path / "old", (50, 52), seed=1)
    set_aside(storage, (50, 52), CORRUPT)
    new = lineage(storage, tmp_path / "new", (50, 60, 70), seed=2)

    assert prune(storage, keep=2) == [50]
    assert keys_under(storage, step_prefix(50)) == set()
    time.sleep(1.1)
    assert {i.key for i in sweep_orphans(storage, older_than_s=0).deleted} == old[52]
    assert keys_under(storage, "checkpoints/") == (
        new[60] | new[70] | {manifest_key(60), manifest_key(70)}
    )
    # the records themselves stay
    assert [(r.step, r.reason) for r in aside_records(storage)] == [(50, CORRUPT), (52, CORRUPT)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "record",
    [
        pytest.param(b"{not json", id="not-json"),
        # a newer schema naming its files in a shape this runner does not know
        pytest.param(
            json.dumps({"schema": "99", "step": 50, "files": [["up-x/w.bin", 1, "ab"]]}).encode(),
            id="files-of-another-shape",
        ),
        # what decommit_remote keeps of a manifest too large to copy
        pytest.param(b'{"note": "the de-committed manifest was too large to copy"}\n', id="note"),
    ],
)
def test_a_record_that_cannot_be_read_keeps_every_object_of_its_step(
    any_storage: Storage, tmp_path: Path, record: bytes
) -> None:
    storage = any_storage
    old = lineage(storage, tmp_path / "old", (50,), seed=1)
    set_aside(storage, (50,), FOREIGN)
    (key,) = [i.key for i in storage.list("aside/")]
    storage.delete(key)
    storage.put_bytes(key, record)
    new = lineage(storage, tmp_path / "new", (50, 60, 70), seed=2)

    assert prune(storage, keep=2) == [50]  # de-committed, but nothing under it deleted
    assert keys_under(storage, step_prefix(50)) == old[50] | new[50]
    time.sleep(1.1)
    assert sweep_orphans(storage, older_than_s=0).deleted == []
    assert keys_under(storage, step_prefix(50)) == old[50] | new[50]


@pytest.mark.slow
def test_prune_cli_says_what_aside_records_kept(any_storage: Storage, tmp_path: Path) -> None:
    storage = any_storage
    old = lineage(storage, tmp_path / "old", (50, 52), seed=1)
    set_aside(storage, (50, 52), SUPERSEDED)
    new = lineage(storage, tmp_path / "new", (50, 60, 70), seed=2)
    kept = sorted(old[50] | old[52])
    sizes = {info.key: info.size for info in storage.list("checkpoints/")}
    time.sleep(1.1)

    done = runner("prune", storage.uri, "--keep", "2", "--orphan-age-hours", "0", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "deleted": [50],
        "orphans_deleted": [],
        "orphan_bytes": 0,
        "aside_kept": kept,
        "aside_kept_bytes": sum(sizes[k] for k in kept),
    }
    assert keys_under(storage, step_prefix(50)) == old[50]

    done = runner("prune", storage.uri, "--keep", "2", "--orphan-age-hours", "0")
    assert done.returncode == 0, done.stderr
    assert "nothing to prune" in done.stdout
    assert f"kept {len(kept)} objects (" in done.stdout and "that aside records name" in done.stdout
    assert [missing_or_changed(storage, r) for r in aside_records(storage)] == [[], []]
    assert list_checkpoints(storage) == [60, 70] and new[70] <= keys_under(storage, "checkpoints/")


def corrupt_step_over_a_superseded_one(
    storage: Storage, tmp_path: Path
) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """Step 20 of an old lineage set aside as superseded, a new lineage's 20, 30, 40 over it,
    and one byte of the new 20's weights flipped; returns both lineages' keys by step."""
    old = lineage(storage, tmp_path / "old", (20,), seed=1)
    set_aside(storage, (20,), SUPERSEDED)
    new = lineage(storage, tmp_path / "new", (20, 30, 40), seed=2)
    weights = next(k for k in new[20] if k.endswith("weights.bin"))
    flip_byte(storage, weights, tmp_path / "flipped")
    return old, new


@pytest.mark.slow
def test_repair_sets_a_corrupt_step_aside_keeping_what_a_superseded_record_names(
    any_storage: Storage, tmp_path: Path
) -> None:
    storage = any_storage
    old, new = corrupt_step_over_a_superseded_one(storage, tmp_path)

    done = runner("repair", storage.uri)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "step 20: set aside" in done.stdout
    records = aside_records(storage)
    assert [(r.step, r.reason) for r in records] == [(20, SUPERSEDED), (20, CORRUPT)]
    assert missing_or_changed(storage, records[0]) == []
    assert set(records[1].files) == new[20]
    assert list_checkpoints(storage) == [30, 40]

    time.sleep(1.1)
    done = runner("prune", storage.uri, "--keep", "2", "--orphan-age-hours", "0", "--json")
    assert done.returncode == 0, done.stderr
    pruned = json.loads(done.stdout)
    # the corrupt copy is debris the sweep may take; the superseded one is kept
    assert (pruned["deleted"], sorted(pruned["orphans_deleted"])) == ([], sorted(new[20]))
    assert pruned["aside_kept"] == sorted(old[20])
    assert keys_under(storage, step_prefix(20)) == old[20]
    assert missing_or_changed(storage, aside_records(storage)[0]) == []


def test_repair_from_a_good_copy_keeps_what_a_superseded_record_names(
    any_storage: Storage, tmp_path: Path
) -> None:
    storage = any_storage
    old, _new = corrupt_step_over_a_superseded_one(storage, tmp_path)

    done = runner("repair", storage.uri, "--from", str(tmp_path / "new"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 20: restored" in done.stdout
    assert (
        verify_checkpoint(storage, 20).fingerprint
        == make_checkpoint(tmp_path / "again", 20, seed=2).manifest.fingerprint
    )
    (superseded,) = [r for r in aside_records(storage) if r.reason == SUPERSEDED]
    assert missing_or_changed(storage, superseded) == []

    assert prune(storage, keep=2) == [20]  # the restored step goes; the old payload stays
    assert keys_under(storage, step_prefix(20)) == old[20]
    assert missing_or_changed(storage, superseded) == []
