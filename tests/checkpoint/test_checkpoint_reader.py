"""Listing, verifying, falling back, loading safely, and schema migration."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from runner.checkpoint.layout import checkpoint_key
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.verify import newest_verified, scan, verify_checkpoint
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
    from runner.atomicity.files import sha256_file

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
    # hashes alone cannot catch it, but verify reads the counters the way resume loads
    # (weights-only), so it refuses what resume would refuse
    with pytest.raises(IntegrityError, match="weights-only loading refuses"):
        verify_checkpoint(open_storage(tmp_path / "run"), 1)
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
    from runner.atomicity.files import sha256_file

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
    # and the migrated manifest round-trips as v3 (1 -> 2 -> 3)
    assert Manifest.from_json(manifest.to_json()).extra["migrated_from"] == "1"


def test_verify_works_through_file_uri(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> None:
    save_checkpoint(5)
    storage = open_storage(f"file://{tmp_path / 'run'}")
    assert verify_checkpoint(storage, 5).step == 5
    assert checkpoint_key(5) == "checkpoints/step_000005"


def _load_verified(step_dir: Path, manifest: Manifest) -> dict:
    return load_state(step_dir, manifest=manifest, verified=True)


def _newest_loaded(run: Path, **kw: object) -> tuple[Manifest, dict] | None:
    """The newest local checkpoint that verifies and loads, through the one resolver."""
    from runner.mirror.resume import choose_resume

    choice = choose_resume(run, None, load=_load_verified, **kw)  # type: ignore[arg-type]
    return None if choice is None else (choice.manifest, choice.loaded)


def test_newest_loaded_falls_back_past_unloadable_checkpoints(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    good = save_checkpoint(1)
    unsafe = save_checkpoint(2)
    torch.save({"schema": "2", "model": _RunsCode(tmp_path / "ran")}, unsafe.path / "state.pt")
    _refresh_manifest_hashes(unsafe.path)
    corrupt = save_checkpoint(3)
    (corrupt.path / "state.pt").write_bytes(b"x")
    skipped: list[tuple[int, str]] = []
    found = _newest_loaded(tmp_path / "run", on_skip=lambda s, why: skipped.append((s, why)))
    assert found is not None
    manifest, state = found
    assert manifest.step == 1 and manifest.fingerprint == good.manifest.fingerprint
    assert state_fingerprint(state) == good.manifest.fingerprint
    assert [s for s, _ in skipped] == [3, 2]
    assert "size 1 !=" in skipped[0][1] and "weights-only" in skipped[1][1]
    assert not (tmp_path / "ran").exists()
    assert _newest_loaded(tmp_path / "empty") is None


# -- a checkpoint cannot lie about itself ----------------------------------------------------


def _move_to_step(run: Path, src_step: int, dst_step: int) -> Path:
    """Copy checkpoint `src_step` to a directory named for `dst_step`, its manifest edited to
    say `dst_step` (every sha256 still valid): a forged checkpoint."""
    import shutil

    src = run / checkpoint_key(src_step)
    dst = run / checkpoint_key(dst_step)
    shutil.copytree(src, dst)
    _rewrite_manifest(dst, step=dst_step)
    return dst


def test_forged_step_is_refused_by_verify_load_and_newest(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    from runner.checkpoint.verify import verify_dir

    save_checkpoint(2)
    save_checkpoint(3)
    run = tmp_path / "run"
    forged = _move_to_step(run, 3, 999_999_999)
    storage = open_storage(run)
    mismatch = (
        r"step_999999999: the manifest and the payload disagree "
        r"\(step: manifest 999999999, payload 3\)"
    )
    with pytest.raises(IntegrityError, match=mismatch):
        verify_checkpoint(storage, 999_999_999)
    with pytest.raises(IntegrityError, match=mismatch):
        verify_dir(forged)
    with pytest.raises(IntegrityError, match=mismatch):
        load_state(forged)
    skipped: list[tuple[int, str]] = []
    newest = newest_verified(storage, on_skip=lambda s, why: skipped.append((s, why)))
    assert newest is not None and newest.step == 3
    assert [s for s, _ in skipped] == [999_999_999]
    found = _newest_loaded(run)
    assert found is not None and found[0].step == 3 and found[1]["counters"]["step"] == 3


def test_payload_of_another_step_under_an_honest_manifest_is_refused(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    """step_000005 holding step 4's payload, manifest consistent with step 5, hashes fixed."""
    four = save_checkpoint(4)
    five = save_checkpoint(5)
    (five.path / "state.pt").write_bytes((four.path / "state.pt").read_bytes())
    _refresh_manifest_hashes(five.path)
    want = (
        r"step_000005: the manifest and the payload disagree \(step: manifest 5, payload 4; "
        r"samples_seen: manifest 25, payload 20; batch_in_epoch: manifest 5, payload 4\)"
    )
    with pytest.raises(IntegrityError, match=want):
        verify_checkpoint(open_storage(tmp_path / "run"), 5)
    with pytest.raises(IntegrityError, match=want):
        load_state(five.path)


def test_manifest_counters_other_than_step_are_compared_too(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    ckpt = save_checkpoint(3)
    _rewrite_manifest(ckpt.path, world_size=2)
    with pytest.raises(IntegrityError, match=r"\(world_size: manifest 2, payload 1\)"):
        verify_checkpoint(open_storage(tmp_path / "run"), 3)
    _rewrite_manifest(ckpt.path, world_size=1, samples_seen=16)
    with pytest.raises(IntegrityError, match=r"\(samples_seen: manifest 16, payload 15\)"):
        load_state(ckpt.path)


def test_chunked_payload_counters_are_checked(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(2, chunk_bytes=64)
    ckpt = save_checkpoint(3, chunk_bytes=64)
    assert ckpt.manifest.format == "torch-chunked"
    storage = open_storage(tmp_path / "run")
    assert verify_checkpoint(storage, 3).step == 3
    assert load_state(ckpt.path)["counters"]["step"] == 3
    _move_to_step(tmp_path / "run", 2, 7)
    with pytest.raises(IntegrityError, match=r"\(step: manifest 7, payload 2\)"):
        verify_checkpoint(storage, 7)
    with pytest.raises(IntegrityError, match=r"\(step: manifest 7, payload 2\)"):
        load_state(tmp_path / "run" / checkpoint_key(7))


def test_seed_bin_header_step_must_match_the_manifest(tmp_path: Path) -> None:
    import struct

    from runner.checkpoint.convert import adopt_seed_bin

    src = tmp_path / "step_000006.bin"
    src.write_bytes(struct.pack("<ii", 6, 2) + b"\0" * 24)
    writer = CheckpointWriter(tmp_path / "run" / "checkpoints", run_id="r", writer_id="w")
    ckpt = adopt_seed_bin(writer, src, copy=True)
    storage = open_storage(tmp_path / "run")
    assert verify_checkpoint(storage, 6).step == 6
    (ckpt.path / "step_000006.bin").write_bytes(struct.pack("<ii", 5, 2) + b"\0" * 24)
    _refresh_manifest_hashes(ckpt.path)
    with pytest.raises(IntegrityError, match="file name says step 6, its header step 5"):
        verify_checkpoint(storage, 6)


def test_directory_name_must_match_the_manifest_step(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    from runner.checkpoint.listing import read_manifest_dir

    ckpt = save_checkpoint(3)
    moved = ckpt.path.with_name("step_000009")
    ckpt.path.rename(moved)
    with pytest.raises(IntegrityError, match="manifest says step 3, its directory is named step 9"):
        read_manifest_dir(moved)
    with pytest.raises(IntegrityError, match="manifest says step 3, its directory is named step 9"):
        verify_checkpoint(open_storage(tmp_path / "run"), 9)


def test_migrated_v1_checkpoint_compares_only_what_it_stores(tmp_path: Path) -> None:
    """A v1 manifest has no world_size/samples_seen and a v1 payload no samples_seen: those
    are never compared (the v1 test above: payload world_size 2, manifest default 1); the
    step is."""
    state = tiny_train_state(steps=4)
    step_dir = tmp_path / "checkpoints" / "step_000004"
    step_dir.mkdir(parents=True)
    torch.save({**_v1_payload(state), "step": 3}, step_dir / "state.pt")
    from runner.atomicity.files import sha256_file

    size, sha = sha256_file(step_dir / "state.pt")
    v1 = {
        "version": 1,
        "step": 4,
        "created_at": "2026-01-01T00:00:00Z",
        "format": "torch-state",
        "files": {"state.pt": {"size": size, "sha256": sha}},
    }
    (step_dir / "manifest.json").write_text(json.dumps(v1))
    with pytest.raises(IntegrityError, match=r"\(step: manifest 4, payload 3\)"):
        verify_checkpoint(open_storage(tmp_path), 4)


class _CountingStorage:
    """A FileStorage whose readers count the bytes handed out."""

    def __init__(self, root: Path) -> None:
        from runner.storage.file import FileStorage

        self.inner = FileStorage(root)
        self.read_bytes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def local_path(self, key: str = "") -> None:
        return None  # every read goes through the counting methods

    def get_bytes(self, key: str) -> bytes:
        data = self.inner.get_bytes(key)
        self.read_bytes += len(data)
        return data

    def open_read(self, key: str) -> object:
        stream = self.inner.open_read(key)
        outer = self

        class Counted:
            def __enter__(self) -> Counted:
                return self

            def __exit__(self, *exc: object) -> None:
                stream.close()

            def read(self, n: int = -1) -> bytes:
                data = stream.read(n)
                outer.read_bytes += len(data)
                return data

        return Counted()


def test_huge_manifest_is_refused_without_reading_it_all(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    from runner.checkpoint.listing import read_manifest, read_manifest_dir
    from runner.checkpoint.manifest import MAX_MANIFEST_BYTES

    ckpt = save_checkpoint(1)
    with open(ckpt.path / "manifest.json", "r+b") as f:  # 1 GiB, sparse: costs no disk
        f.truncate(1024**3)
    storage = _CountingStorage(tmp_path / "run")
    with pytest.raises(IntegrityError, match=f"larger than the {MAX_MANIFEST_BYTES} bytes"):
        read_manifest(storage, 1)  # type: ignore[arg-type]
    assert storage.read_bytes == 0  # its size was asked first: not one byte read
    with pytest.raises(IntegrityError, match=f"larger than the {MAX_MANIFEST_BYTES} bytes"):
        read_manifest_dir(ckpt.path)
    with pytest.raises(IntegrityError, match="more than the 16777216 a manifest may have"):
        Manifest.from_json(b" " * (MAX_MANIFEST_BYTES + 1))


def test_manifest_claims_are_bounded(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> None:
    base = json.loads(save_checkpoint(1).manifest.to_json())
    entry = base["files"][0]

    def refused(match: str, **changes: object) -> None:
        with pytest.raises(IntegrityError, match=match):
            Manifest.from_json(json.dumps({**base, **changes}).encode())

    many = [{**entry, "path": f"f{i}"} for i in range(100_001)]
    refused("lists 100001 files, more than the 100000 a checkpoint may have", files=many)
    refused("step 1000000000000 is implausible", step=10**12)
    refused("samples_seen 4611686018427387904 is implausible", samples_seen=2**62)
    refused("bad size 1125899906842624 for 'state.pt'", files=[{**entry, "size": 2**50}])
    refused("bad size -1 for 'state.pt'", files=[{**entry, "size": -1}])
    refused("bad size True for 'state.pt'", files=[{**entry, "size": True}])
    refused("is longer than 1024 characters", files=[{**entry, "path": "a/" * 600 + "b"}])
    refused("is longer than 1024 characters", files=[{**entry, "path": "x" * 256}])
    assert Manifest.from_json(json.dumps(base).encode()).step == 1  # the base itself is fine
    with pytest.raises(IntegrityError, match="not valid JSON"):
        Manifest.from_json(b"[" * 100_000 + b"]" * 100_000)  # nesting past the recursion limit
    with pytest.raises(IntegrityError, match="not valid JSON"):
        Manifest.from_json(b'{"step": ' + b"9" * 5000 + b"}")  # past Python's int digit limit


class _Streamed:
    """A run dir seen through the Storage protocol only (not a FileStorage): the path an
    s3:// location takes, without a server."""

    def __init__(self, root: Path) -> None:
        from runner.storage.file import FileStorage

        self.inner = FileStorage(root)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def local_path(self, key: str = "") -> None:
        return None  # like s3://: nothing is worked on in place


def test_streamed_verify_checks_counters_within_its_bound_and_download_always(
    tmp_path: Path, save_checkpoint: SaveCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runner.checkpoint.counter_check as counter_check
    from runner.mirror import download_checkpoint

    save_checkpoint(3)
    _move_to_step(tmp_path / "run", 3, 8)
    save_checkpoint(2, chunk_bytes=64)
    _move_to_step(tmp_path / "run", 2, 9)
    storage = _Streamed(tmp_path / "run")
    assert verify_checkpoint(storage, 3).step == 3  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match=r"\(step: manifest 8, payload 3\)"):
        verify_checkpoint(storage, 8)  # type: ignore[arg-type]
    with pytest.raises(IntegrityError, match=r"\(step: manifest 9, payload 2\)"):
        verify_checkpoint(storage, 9)  # type: ignore[arg-type]  # chunked: the skeleton
    # a state.pt over the bound is not streamed twice: verify passes on hashes alone...
    monkeypatch.setattr(counter_check, "REMOTE_COUNTER_CHECK_MAX_BYTES", 0)
    assert verify_checkpoint(storage, 8).step == 8  # type: ignore[arg-type]
    # ...and the download refuses it before anything is published
    dest = tmp_path / "dest"
    with pytest.raises(IntegrityError, match=r"\(step: manifest 8, payload 3\)"):
        download_checkpoint(storage, 8, dest)  # type: ignore[arg-type]
    assert list((dest / "checkpoints").iterdir()) == []
    assert download_checkpoint(storage, 3, dest) == dest / checkpoint_key(3)  # type: ignore[arg-type]
