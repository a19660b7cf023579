"""Manifest schema 3: the size-chunked layout is `torch-chunked`; schema 1 and 2 checkpoints
(schema 2's `torch-sharded` included) keep verifying and loading. A manifest is written with the
lowest schema that expresses it: "2" for torch-state and seed-bin (what a runner that reads only
1 and 2 reads), "3" for torch-chunked; reading, uploading and downloading keep it so."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import (
    FORMAT_CHUNKED,
    FORMAT_DCP,
    FORMAT_FILES,
    FORMAT_SEED_BIN,
    FORMAT_TORCH,
    SCHEMA_VERSION,
    SUPPORTED_SCHEMAS,
    Manifest,
    migrate,
    schema_for,
)
from runner.checkpoint.verify import verify_checkpoint, verify_dir
from runner.checkpoint.writer import CheckpointWriter
from runner.errors import SchemaError
from runner.mirror.download import download_checkpoint
from runner.mirror.upload import upload_checkpoint
from runner.storage import open_storage
from tests.fixtures.ckpt import (
    make_checkpoint,
    meta_for,
    state_fingerprint,
    tiny_train_state,
    tree_hashes,
)
from tests.fixtures.demo_process import run_demo

# Written by the runner of commit fa150d1 (manifest schema 2): CheckpointWriter(shard_bytes=64)
# .write_state(tiny_train_state(seed=7, steps=2)); its files are those bytes, unedited.
V2_SHARDED = Path(__file__).parent / "data" / "v2_torch_sharded" / "step_000002"
V2_FINGERPRINT = "f8cd150cc7d2d095c8a191d4eda4172da0d91fa9929f84fda5d88791d5fbdac2"


def _v2_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(V2_SHARDED, run / "checkpoints" / V2_SHARDED.name)
    return run


def test_schema_versions() -> None:
    assert (SCHEMA_VERSION, SUPPORTED_SCHEMAS) == ("5", ("1", "2", "3", "4", "5"))
    formats = (FORMAT_TORCH, FORMAT_SEED_BIN, FORMAT_CHUNKED, FORMAT_DCP, FORMAT_FILES)
    assert [schema_for(f) for f in formats] == ["2", "2", "3", "4", "5"]


def test_schema_2_torch_sharded_checkpoint_of_the_old_runner_verifies_and_loads(
    tmp_path: Path,
) -> None:
    run = _v2_run(tmp_path)
    step_dir = run / "checkpoints" / "step_000002"
    on_disk = json.loads((step_dir / "manifest.json").read_bytes())
    assert (on_disk["schema"], on_disk["format"]) == ("2", "torch-sharded")
    assert json.loads((step_dir / "index.json").read_bytes())["schema"] == "1"

    manifest = verify_checkpoint(open_storage(run), 2)
    # torch-chunked in memory, still schema 2: its layout (index schema 1) is schema 2's
    assert (manifest.schema, manifest.format) == ("2", FORMAT_CHUNKED)
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
    # and it is written back as it was: schema 2, `torch-sharded`, the same bytes
    assert manifest.to_json() == (step_dir / "manifest.json").read_bytes()
    again = Manifest.from_json(manifest.to_json())
    assert (again.schema, again.format, again.files) == ("2", FORMAT_CHUNKED, manifest.files)


def test_schema_2_torch_sharded_checkpoint_uploads_and_downloads_as_it_was(
    tmp_path: Path,
) -> None:
    run = _v2_run(tmp_path)
    step_dir = run / "checkpoints" / "step_000002"
    before = tree_hashes(step_dir)
    mirror = open_storage(tmp_path / "mirror")
    uploaded = upload_checkpoint(mirror, step_dir)
    remote = json.loads(mirror.get_bytes("checkpoints/step_000002/manifest.json"))
    assert (remote["schema"], remote["format"]) == ("2", "torch-sharded")
    assert (uploaded.schema, uploaded.format) == ("2", FORMAT_CHUNKED)
    assert verify_checkpoint(mirror, 2).fingerprint == V2_FINGERPRINT

    pulled = download_checkpoint(mirror, 2, tmp_path / "pulled")
    # every file byte for byte as the old runner wrote it, the manifest included
    assert tree_hashes(pulled) == before == tree_hashes(V2_SHARDED)
    assert state_fingerprint(load_state(pulled)) == V2_FINGERPRINT


def test_a_fork_of_a_schema_2_torch_sharded_checkpoint_is_schema_3_with_the_same_files(
    tmp_path: Path,
) -> None:
    """A fork writes a new checkpoint (its own run_id) from the old files: it says v3
    `torch-chunked`, its payload files are the old runner's bytes, and it verifies."""
    from runner.mirror.fork import fork_run

    fork_run(open_storage(_v2_run(tmp_path)), tmp_path / "fork", writer_id="w")
    step_dir = tmp_path / "fork" / "checkpoints" / "step_000002"
    data = json.loads((step_dir / "manifest.json").read_bytes())
    assert (data["schema"], data["format"]) == ("3", "torch-chunked")
    payload = {k: v for k, v in tree_hashes(step_dir).items() if k != "manifest.json"}
    assert payload == {k: v for k, v in tree_hashes(V2_SHARDED).items() if k != "manifest.json"}
    assert verify_dir(step_dir).fingerprint == V2_FINGERPRINT


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
    assert data["schema"] == "2"
    assert (data["format"], data["samples_seen"], data["world_size"]) == ("torch-state", 20, 1)
    assert data["files"] == [{"path": "state.pt", "size": 3, "sha256": "b" * 64}]
    assert data["extra"] == {
        "migrated_from": "1",
        "v1_counters": ["batch_in_epoch", "epoch", "step"],
    }
    assert Manifest.from_json(json.dumps(v1).encode()).schema == "2"


def test_migration_from_schema_2() -> None:
    sharded = migrate(_v2(format="torch-sharded"), source="m")
    assert sharded == _v2(schema="2", format="torch-chunked")
    for fmt in ("torch-state", "seed-bin"):
        assert migrate(_v2(format=fmt), source="m") == _v2(format=fmt)
    assert Manifest.from_json(json.dumps(_v2(format="torch-sharded")).encode()).format == (
        "torch-chunked"
    )
    # schema 3's name in a schema-2 manifest (no runner writes one): read as schema 3 says
    assert migrate(_v2(format="torch-chunked"), source="m") == _v2(
        schema="3", format="torch-chunked"
    )
    # a format neither schema names keeps its schema (the reader refuses the format)
    assert migrate(_v2(format="torch-future"), source="m") == _v2(format="torch-future")


def test_schema_3_is_read_as_it_is_and_a_newer_one_than_5_is_refused() -> None:
    current = _v2(schema="3", format="torch-chunked")
    assert migrate(dict(current), source="m") == current
    assert migrate(_v2(schema="3", format="torch-sharded"), source="m") == _v2(
        schema="3", format="torch-sharded"
    )
    with pytest.raises(SchemaError, match=r"unknown schema version '6'.*a newer spot-runner"):
        migrate(_v2(schema="6"), source="m")


def test_schema_3_torch_state_and_seed_bin_manifests_are_accepted_as_schema_2() -> None:
    """Accepted, not refused: the runner between the rename and the lowest-schema rule wrote
    every checkpoint as schema 3, and a schema-3 torch-state is a schema-2 one in all but the
    label. Read as schema 2, so a copy written from it (upload, download) says "2"."""
    for fmt in (FORMAT_TORCH, FORMAT_SEED_BIN):
        assert migrate(_v2(schema="3", format=fmt), source="m") == _v2(format=fmt)
        manifest = Manifest.from_json(json.dumps(_v2(schema="3", format=fmt)).encode())
        assert manifest.schema == "2"
        assert json.loads(manifest.to_json()) == _v2(format=fmt)


def _rewrite_schema(step_dir: Path, schema: str) -> bytes:
    data = json.loads((step_dir / "manifest.json").read_bytes())
    raw = (json.dumps({**data, "schema": schema}, indent=2, sort_keys=True) + "\n").encode()
    (step_dir / "manifest.json").write_bytes(raw)
    return raw


def test_schema_3_torch_state_checkpoint_verifies_and_uploads_as_schema_2(
    tmp_path: Path,
) -> None:
    state = tiny_train_state(steps=2)
    ckpt = CheckpointWriter(tmp_path / "run" / "checkpoints", run_id="r", writer_id="w")
    committed = ckpt.write_state(state, meta=meta_for(state, fingerprint=state_fingerprint(state)))
    written = (committed.path / "manifest.json").read_bytes()
    raw = _rewrite_schema(committed.path, "3")
    assert verify_checkpoint(open_storage(tmp_path / "run"), 2).schema == "2"
    assert (committed.path / "manifest.json").read_bytes() == raw  # read, never rewritten

    mirror = open_storage(tmp_path / "mirror")
    upload_checkpoint(mirror, committed.path)
    remote = json.loads(mirror.get_bytes("checkpoints/step_000002/manifest.json"))
    assert (remote["schema"], remote["format"]) == ("2", "torch-state")
    pulled = download_checkpoint(mirror, 2, tmp_path / "pulled")
    assert (pulled / "manifest.json").read_bytes() == written


def test_new_checkpoints_are_written_with_the_lowest_schema(tmp_path: Path) -> None:
    def on_disk(path: Path) -> tuple[str, str]:
        data = json.loads((path / "manifest.json").read_bytes())
        return data["schema"], data["format"]

    state = tiny_train_state(steps=1)
    ckpt = CheckpointWriter(tmp_path / "checkpoints", run_id="r", writer_id="w").write_state(
        state, meta=meta_for(state)
    )
    assert on_disk(ckpt.path) == ("2", "torch-state")
    chunked = CheckpointWriter(
        tmp_path / "chunked" / "checkpoints", run_id="r", writer_id="w", chunk_bytes=256
    ).write_state(state, meta=meta_for(state))
    assert on_disk(chunked.path) == ("3", "torch-chunked")
    assert verify_dir(chunked.path).schema == "3"
    seed = make_checkpoint(tmp_path / "seed", 1, size=64)
    assert on_disk(seed.path) == ("2", "seed-bin")


def test_a_manifest_claiming_more_than_its_format_needs_is_never_written() -> None:
    manifest = Manifest.from_json(json.dumps(_v2()).encode())
    manifest.schema = "3"
    with pytest.raises(SchemaError, match=r"schema '3' for format 'torch-state'.*the lowest"):
        manifest.validate()


# The fields of `runner demo --steps 20 --ckpt-every 10`'s manifests as the runner of commit
# 9fce004 (before the restructure) wrote them, byte for byte apart from created_at, run_id and
# writer. What depends on floating point (sha256, size, fingerprint) is checked for form only.
DEMO_9FCE004_FIELDS = [
    "batch_in_epoch",
    "created_at",
    "epoch",
    "extra",
    "files",
    "fingerprint",
    "format",
    "run_id",
    "samples_seen",
    "schema",
    "step",
    "world_size",
    "writer",
]
DEMO_9FCE004_VALUES: dict[int, dict[str, Any]] = {
    10: {"schema": "2", "format": "torch-state", "step": 10, "samples_seen": 160,
         "world_size": 1, "epoch": 0, "batch_in_epoch": 10, "extra": {"reason": "steps"}},
    20: {"schema": "2", "format": "torch-state", "step": 20, "samples_seen": 320,
         "world_size": 1, "epoch": 0, "batch_in_epoch": 20, "extra": {"reason": "final"}},
}  # fmt: skip


@pytest.mark.slow
def test_demo_manifests_are_those_of_the_runner_before_the_restructure(tmp_path: Path) -> None:
    done = run_demo(tmp_path / "run", steps=20, ckpt_every=10)
    assert done.returncode == 0, done.stdout + done.stderr
    for step, values in DEMO_9FCE004_VALUES.items():
        step_dir = tmp_path / "run" / "checkpoints" / f"step_{step:06d}"
        raw = (step_dir / "manifest.json").read_bytes()
        data = json.loads(raw)
        assert sorted(data) == DEMO_9FCE004_FIELDS
        assert {k: data[k] for k in values} == values
        assert raw == (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
        state = (step_dir / "state.pt").read_bytes()
        assert data["files"] == [
            {"path": "state.pt", "size": len(state), "sha256": hashlib.sha256(state).hexdigest()}
        ]
        assert len(data["fingerprint"]) == 64 and int(data["fingerprint"], 16) >= 0
