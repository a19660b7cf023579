"""Manifest schema 3: the size-chunked layout is `torch-chunked`; schema 1 and 2 checkpoints
(schema 2's `torch-sharded` included) keep verifying and loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import (
    FORMAT_CHUNKED,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMAS,
    Manifest,
    migrate,
)
from runner.checkpoint.verify import verify_checkpoint, verify_dir
from runner.errors import SchemaError
from runner.storage import open_storage
from tests.fixtures.ckpt import state_fingerprint, tiny_train_state

# Written by the runner of commit fa150d1 (manifest schema 2): CheckpointWriter(shard_bytes=64)
# .write_state(tiny_train_state(seed=7, steps=2)); its files are those bytes, unedited.
V2_SHARDED = Path(__file__).parent / "data" / "v2_torch_sharded" / "step_000002"
V2_FINGERPRINT = "f8cd150cc7d2d095c8a191d4eda4172da0d91fa9929f84fda5d88791d5fbdac2"


def _v2_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(V2_SHARDED, run / "checkpoints" / V2_SHARDED.name)
    return run


def test_schema_versions() -> None:
    assert (SCHEMA_VERSION, SUPPORTED_SCHEMAS) == ("3", ("1", "2", "3"))


def test_schema_2_torch_sharded_checkpoint_of_the_old_runner_verifies_and_loads(
    tmp_path: Path,
) -> None:
    run = _v2_run(tmp_path)
    step_dir = run / "checkpoints" / "step_000002"
    on_disk = json.loads((step_dir / "manifest.json").read_bytes())
    assert (on_disk["schema"], on_disk["format"]) == ("2", "torch-sharded")
    assert json.loads((step_dir / "index.json").read_bytes())["schema"] == "1"

    manifest = verify_checkpoint(open_storage(run), 2)
    assert (manifest.schema, manifest.format) == ("3", FORMAT_CHUNKED)
    assert manifest.fingerprint == V2_FINGERPRINT
    assert "migrated_from" not in manifest.extra
    assert verify_dir(step_dir).format == FORMAT_CHUNKED
    loaded = load_state(step_dir)
    assert state_fingerprint(loaded) == V2_FINGERPRINT
    expected = tiny_train_state(seed=7, steps=2)
    assert loaded["counters"] == expected["counters"]
    assert loaded["loss_history"] == expected["loss_history"]
    assert list(loaded["model"]) == list(expected["model"])
    # reading migrates in memory only: the checkpoint's bytes are as the old runner wrote them
    assert json.loads((step_dir / "manifest.json").read_bytes()) == on_disk
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        p.name for p in V2_SHARDED.iterdir()
    )
    # and the migrated manifest round-trips as v3
    again = Manifest.from_json(manifest.to_json())
    assert (again.schema, again.format, again.files) == ("3", FORMAT_CHUNKED, manifest.files)


def _v2(**fields: object) -> dict[str, object]:
    data: dict[str, object] = {
        "schema": "2",
        "step": 4,
        "samples_seen": 20,
        "world_size": 1,
        "epoch": 0,
        "batch_in_epoch": 4,
        "created_at": "2026-01-01T00:00:00.000000Z",
        "run_id": "r",
        "writer": "w",
        "format": "torch-state",
        "fingerprint": "a" * 64,
        "files": [{"path": "state.pt", "size": 3, "sha256": "b" * 64}],
        "extra": {"reason": "steps"},
    }
    data.update(fields)
    return data


def test_migration_from_schema_1() -> None:
    v1 = {
        "version": 1,
        "step": 4,
        "epoch": 1,
        "batch_in_epoch": 2,
        "created_at": "2026-01-01T00:00:00Z",
        "format": "torch-state",
        "batch_size": 5,
        "files": {"state.pt": {"size": 3, "sha256": "b" * 64}},
    }
    data = migrate(v1, source="m")
    assert data["schema"] == "3"
    assert (data["format"], data["samples_seen"], data["world_size"]) == ("torch-state", 20, 1)
    assert data["files"] == [{"path": "state.pt", "size": 3, "sha256": "b" * 64}]
    assert data["extra"] == {
        "migrated_from": "1",
        "v1_counters": ["batch_in_epoch", "epoch", "step"],
    }
    assert Manifest.from_json(json.dumps(v1).encode()).schema == "3"


def test_migration_from_schema_2() -> None:
    sharded = migrate(_v2(format="torch-sharded"), source="m")
    assert sharded == _v2(schema="3", format="torch-chunked")
    for fmt in ("torch-state", "seed-bin"):
        assert migrate(_v2(format=fmt), source="m") == _v2(schema="3", format=fmt)
    assert Manifest.from_json(json.dumps(_v2(format="torch-sharded")).encode()).format == (
        "torch-chunked"
    )


def test_schema_3_is_current_and_a_newer_one_is_refused() -> None:
    current = _v2(schema="3", format="torch-chunked")
    assert migrate(dict(current), source="m") == current
    with pytest.raises(SchemaError, match=r"unknown schema version '4'.*a newer spot-runner"):
        migrate(_v2(schema="4"), source="m")


def test_new_checkpoints_are_schema_3(tmp_path: Path) -> None:
    from runner.checkpoint.writer import CheckpointWriter
    from tests.fixtures.ckpt import meta_for

    state = tiny_train_state(steps=1)
    ckpt = CheckpointWriter(tmp_path / "checkpoints", run_id="r", writer_id="w").write_state(
        state, meta=meta_for(state)
    )
    on_disk = json.loads((ckpt.path / "manifest.json").read_bytes())
    assert (on_disk["schema"], on_disk["format"]) == ("3", "torch-state")
