"""Listing, verifying, falling back, loading safely, and schema migration."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from runner.checkpoint.layout import checkpoint_key
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.reader import (
    list_checkpoints,
    load_state,
    newest_verified,
    scan,
    verify_checkpoint,
)
from runner.checkpoint.writer import CheckpointWriter
from runner.errors import IntegrityError, SchemaError
from runner.storage import open_storage
from tests.fixtures.ckpt import SaveCheckpoint, meta_for, state_fingerprint, tiny_train_state


def _rewrite_manifest(step_dir: Path, **changes: object) -> None:
    data = json.loads((step_dir / "manifest.json").read_bytes())
    data.update(changes)
    (step_dir / "manifest.json").write_text(json.dumps(data))


def test_list_is_numeric_and_ignores_temp_and_manifestless_dirs(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    for step in (9, 10, 100):
        save_checkpoint(step)
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / ".tmp-step_000200-1-abc").mkdir()
    (ckpts / ".tmp-step_000200-1-abc" / "manifest.json").write_text("{}")
    (ckpts / "step_000300").mkdir()  # debris without a manifest: not a checkpoint
    assert list_checkpoints(open_storage(tmp_path / "run")) == [9, 10, 100]


def test_newest_verified_falls_back_and_reports_the_skip(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(2)
    newest = save_checkpoint(3)
    payload = newest.path / "state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))
    skipped: list[tuple[int, str]] = []
    storage = open_storage(tmp_path / "run")
    manifest = newest_verified(storage, on_skip=lambda s, why: skipped.append((s, why)))
    assert manifest is not None and manifest.step == 2
    assert len(skipped) == 1 and skipped[0][0] == 3
    assert "step_000003/state.pt: sha256 mismatch" in skipped[0][1]
    statuses = scan(storage)
    assert [(s.step, s.ok) for s in statuses] == [(3, False), (2, True)]


def test_verify_names_a_missing_file(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> None:
    ckpt = save_checkpoint(1)
    (ckpt.path / "state.pt").unlink()
    with pytest.raises(IntegrityError, match=r"step_000001/state.pt: listed in the manifest but"):
        verify_checkpoint(open_storage(tmp_path / "run"), 1)
    with pytest.raises(IntegrityError, match="missing"):
        load_state(ckpt.path)


def test_truncated_payload_is_refused_before_deserialising(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    ckpt = save_checkpoint(1)
    payload = ckpt.path / "state.pt"
    payload.write_bytes(payload.read_bytes()[:-10])
    with pytest.raises(IntegrityError, match=r"size \d+ != \d+ in the manifest"):
        load_state(ckpt.path)


@pytest.mark.parametrize("bad_path", ["../x", "/etc/passwd", "a/../../x", "./state.pt"])
def test_manifest_path_outside_the_directory_is_refused(
    tmp_path: Path, save_checkpoint: SaveCheckpoint, bad_path: str
) -> None:
    ckpt = save_checkpoint(1)
    (tmp_path / "run" / "checkpoints" / "x").write_bytes(b"secret")
    entry = {"path": bad_path, "size": 6, "sha256": "0" * 64}
    _rewrite_manifest(ckpt.path, files=[entry])
    with pytest.raises(IntegrityError, match="refusing to read it"):
        load_state(ckpt.path)
    with pytest.raises(IntegrityError, match="refusing to read it"):
        verify_checkpoint(open_storage(tmp_path / "run"), 1)


def test_symlink_out_of_the_directory_is_refused(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    ckpt = save_checkpoint(1)
    payload = ckpt.path / "state.pt"
    outside = tmp_path / "outside.pt"
    outside.write_bytes(payload.read_bytes())
    payload.unlink()
    payload.symlink_to(outside)
    with pytest.raises(IntegrityError, match="resolves outside the checkpoint directory"):
        load_state(ckpt.path)


def test_unknown_manifest_schema_is_refused(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    ckpt = save_checkpoint(1)
    _rewrite_manifest(ckpt.path, schema="99")
    with pytest.raises(SchemaError, match="unknown schema version '99'"):
        load_state(ckpt.path)


def test_unknown_payload_schema_is_refused(tmp_path: Path) -> None:
    state = {**tiny_train_state(steps=1), "schema": "99"}
    writer = CheckpointWriter(tmp_path / "checkpoints", run_id="r", writer_id="w")
    with pytest.raises(SchemaError, match="refusing to write a payload with schema '99'"):
        writer.write_state(state, meta=meta_for(state))
    # a payload written by a newer runner (forged here by hand) is refused on load
    ok = tiny_train_state(steps=1)
    ckpt = writer.write_state(ok, meta=meta_for(ok))
    torch.save(state, ckpt.path / "state.pt")
    _refresh_manifest_hashes(ckpt.path)
    with pytest.raises(SchemaError, match="unknown payload schema '99'"):
        load_state(ckpt.path)


class _RunsCode:
    """Pickles to a call of os.system: what a malicious payload looks like."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _refresh_manifest_hashes(step_dir: Path) -> None:
    """Make the manifest match the files as they are now (an attacker who controls both)."""
    from runner.checkpoint.atomic import sha256_file

    data = json.loads((step_dir / "manifest.json").read_bytes())
    for f in data["files"]:
        f["size"], f["sha256"] = sha256_file(step_dir / f["path"])
    (step_dir / "manifest.json").write_text(json.dumps(data))


def test_payload_whose_pickle_runs_code_is_refused_and_the_code_never_runs(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    ckpt = save_checkpoint(1)
    marker = tmp_path / "pwned"
    torch.save({"schema": "2", "model": _RunsCode(marker)}, ckpt.path / "state.pt")
    _refresh_manifest_hashes(ckpt.path)
    verify_checkpoint(open_storage(tmp_path / "run"), 1)  # integrity alone cannot catch it
    with pytest.raises(IntegrityError, match="weights-only loading refuses"):
        load_state(ckpt.path)
    assert not marker.exists()
    # the payload really is hostile: an unsafe load would have run it
    torch.load(ckpt.path / "state.pt", weights_only=False)
    assert marker.exists()


def _v1_payload(state: dict) -> dict:
    c = state["counters"]
    return {
        "model": state["model"],
        "optimizer": state["optimizer"],
        "scheduler": {},
        "step": c["step"],
        "epoch": 1,
        "batch_in_epoch": 2,
        "world_size": 2,
        "batch_size": 5,
        "rng": state["rng"],
        "sampler": {},
        "loss_history": state["loss_history"],
    }


def test_v1_checkpoint_migrates_to_v2_on_load(tmp_path: Path) -> None:
    state = tiny_train_state(steps=4)
    step_dir = tmp_path / "checkpoints" / "step_000004"
    step_dir.mkdir(parents=True)
    torch.save(_v1_payload(state), step_dir / "state.pt")
    from runner.checkpoint.atomic import sha256_file

    size, sha = sha256_file(step_dir / "state.pt")
    v1_manifest = {
        "version": 1,
        "step": 4,
        "epoch": 1,
        "batch_in_epoch": 2,
        "created_at": "2026-01-01T00:00:00Z",
        "format": "torch-state",
        "batch_size": 5,
        "files": {"state.pt": {"size": size, "sha256": sha}},
    }
    (step_dir / "manifest.json").write_text(json.dumps(v1_manifest))

    manifest = verify_checkpoint(open_storage(tmp_path), 4)
    assert (manifest.schema, manifest.samples_seen, manifest.world_size) == ("2", 20, 1)
    assert manifest.extra["migrated_from"] == "1"
    loaded = load_state(step_dir)
    assert loaded["schema"] == "2"
    assert loaded["counters"] == {
        "step": 4,
        "epoch": 1,
        "batch_in_epoch": 2,
        "world_size": 2,
        "samples_seen": 40,
    }
    assert loaded["param_names"] == []
    assert loaded["extra"] == {"migrated_from": "1"}
    assert state_fingerprint(loaded) == state_fingerprint(state)
    assert "step" not in loaded and "batch_size" not in loaded
    # and the migrated manifest round-trips as v2
    assert Manifest.from_json(manifest.to_json()).extra["migrated_from"] == "1"


def test_verify_works_through_file_uri(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> None:
    save_checkpoint(5)
    storage = open_storage(f"file://{tmp_path / 'run'}")
    assert verify_checkpoint(storage, 5).step == 5
    assert checkpoint_key(5) == "checkpoints/step_000005"


def test_load_newest_state_falls_back_past_unloadable_checkpoints(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    from runner.checkpoint.reader import load_newest_state

    good = save_checkpoint(1)
    unsafe = save_checkpoint(2)
    torch.save({"schema": "2", "model": _RunsCode(tmp_path / "ran")}, unsafe.path / "state.pt")
    _refresh_manifest_hashes(unsafe.path)
    corrupt = save_checkpoint(3)
    (corrupt.path / "state.pt").write_bytes(b"x")
    skipped: list[tuple[int, str]] = []
    found = load_newest_state(tmp_path / "run", on_skip=lambda s, why: skipped.append((s, why)))
    assert found is not None
    manifest, state = found
    assert manifest.step == 1 and manifest.fingerprint == good.manifest.fingerprint
    assert state_fingerprint(state) == good.manifest.fingerprint
    assert [s for s, _ in skipped] == [3, 2]
    assert "size 1 !=" in skipped[0][1] and "weights-only" in skipped[1][1]
    assert not (tmp_path / "ran").exists()
    assert load_newest_state(tmp_path / "empty") is None
