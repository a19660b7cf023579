"""The mirror's commit protocol, from the store's side: every payload object is stored and
checked before the manifest is written, and a payload that fails to store never leads to a
manifest. The store is a real file:// storage that records the calls made on it
(tests/fixtures/recording_storage.py), for upload_checkpoint and for the Mirror's background
and final uploads, on a single-file and on a chunked (several files) checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.checkpoint.layout import checkpoint_key, manifest_key
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.verify import verify_checkpoint
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import IntegrityError
from runner.mirror import Mirror, upload_checkpoint
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import SaveCheckpoint
from tests.fixtures.recording_storage import RecordingStorage

WRITES = ("put_file", "put_bytes", "delete")
Make = Callable[[SaveCheckpoint, int], CommittedCheckpoint]


@pytest.fixture
def store(tmp_path: Path) -> RecordingStorage:
    return RecordingStorage(tmp_path / "bucket")


def single_file(save_checkpoint: SaveCheckpoint, step: int) -> CommittedCheckpoint:
    ckpt = save_checkpoint(step)
    assert [f.path for f in ckpt.manifest.files] == ["state.pt"]
    return ckpt


def chunked(save_checkpoint: SaveCheckpoint, step: int) -> CommittedCheckpoint:
    ckpt = save_checkpoint(step, chunk_bytes=256)
    assert len(ckpt.manifest.files) >= 4  # skeleton, index and at least two chunks
    return ckpt


def assert_payload_then_manifest(store: RecordingStorage, remote: Manifest) -> None:
    """Each of the manifest's files was put once and then checked (head), and all of that
    ended before the one manifest put started; nothing under the step was written after."""
    step = remote.step
    (manifest_put,) = store.find("put_bytes", manifest_key(step))
    assert manifest_put.error is None
    for entry in remote.files:
        key = f"{checkpoint_key(step)}/{entry.path}"
        (put,) = store.find("put_file", key)
        (check,) = [c for c in store.find("head", key) if c.started > put.started]
        assert put.error is None and check.error is None, key
        assert put.ended is not None and put.ended < check.started, key
        assert check.ended is not None and check.ended < manifest_put.started, key
    later_writes = [
        (c.op, c.key)
        for c in store.calls
        if c.op in WRITES
        and c.key.startswith(checkpoint_key(step) + "/")
        and c.started > manifest_put.started
    ]
    assert later_writes == []
    # and what the manifest names is what was stored
    assert verify_checkpoint(store.inner, step).to_json() == remote.to_json()


def stored_payload_files(store: RecordingStorage, step: int) -> list[str]:
    return sorted(
        key for op, key in store.ops(under=checkpoint_key(step) + "/") if op == "put_file"
    )


def corrupt_one_file(ckpt: CommittedCheckpoint) -> str:
    """Flip a byte in the last payload file: its put's sha256 check fails."""
    name = ckpt.manifest.files[-1].path
    path = ckpt.path / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return name


@pytest.mark.parametrize("make", [single_file, chunked], ids=["single-file", "chunked"])
def test_upload_checkpoint_stores_and_checks_every_file_before_the_manifest(
    store: RecordingStorage, save_checkpoint: SaveCheckpoint, make: Make
) -> None:
    ckpt = make(save_checkpoint, 3)
    remote = upload_checkpoint(store, ckpt.path, writer_id="pod-a")
    assert len(remote.files) == len(ckpt.manifest.files)
    assert_payload_then_manifest(store, remote)
    assert len(stored_payload_files(store, 3)) == len(ckpt.manifest.files)


def test_mirror_background_and_final_uploads_store_every_file_before_the_manifest(
    store: RecordingStorage, save_checkpoint: SaveCheckpoint
) -> None:
    mirror = Mirror(store, keep=3, writer_id="pod-a")
    try:
        mirror.submit(single_file(save_checkpoint, 10))
        assert mirror.wait_idle(timeout=60)
        final = chunked(save_checkpoint, 20)
        assert mirror.upload_now(final, deadline=time.monotonic() + 60) is True
    finally:
        mirror.close(timeout=60)
    assert list_checkpoints(store.inner) == [10, 20]
    for step in (10, 20):
        assert_payload_then_manifest(store, verify_checkpoint(store.inner, step))


@pytest.mark.parametrize("make", [single_file, chunked], ids=["single-file", "chunked"])
def test_a_payload_put_that_fails_never_leads_to_a_manifest_put(
    store: RecordingStorage, save_checkpoint: SaveCheckpoint, make: Make
) -> None:
    ckpt = make(save_checkpoint, 5)
    name = corrupt_one_file(ckpt)
    with pytest.raises(IntegrityError, match=name.replace(".", r"\.")):
        upload_checkpoint(store, ckpt.path, writer_id="pod-a")

    failed = [c for c in store.calls if c.op == "put_file" and c.error is not None]
    assert [(c.key.rsplit("/", 1)[1], c.error) for c in failed] == [(name, "IntegrityError")]
    assert store.find("put_bytes", manifest_key(5)) == []
    assert list(store.inner.list()) == []  # and this attempt's objects are removed


def test_mirror_a_payload_put_that_fails_never_leads_to_a_manifest_put(
    store: RecordingStorage, save_checkpoint: SaveCheckpoint
) -> None:
    background = chunked(save_checkpoint, 30)
    background_bad = corrupt_one_file(background)
    final = single_file(save_checkpoint, 40)
    final_bad = corrupt_one_file(final)
    mirror = Mirror(store, keep=3, writer_id="pod-a")
    try:
        mirror.submit(background)
        assert mirror.wait_idle(timeout=60)
        assert mirror.upload_now(final, deadline=time.monotonic() + 60) is False
    finally:
        mirror.close(timeout=60)
    failed = [
        (c.key.split("/")[1], c.key.rsplit("/", 1)[1], c.error)
        for c in store.calls
        if c.op == "put_file" and c.error is not None
    ]
    assert failed == [
        ("step_000030", background_bad, "IntegrityError"),
        ("step_000040", final_bad, "IntegrityError"),
    ]
    assert [c for c in store.calls if c.op == "put_bytes"] == []
    assert list_checkpoints(store.inner) == []


def test_the_order_check_fails_on_a_manifest_written_before_its_files(
    store: RecordingStorage, save_checkpoint: SaveCheckpoint, tmp_path: Path
) -> None:
    """The calls upload_checkpoint makes, made by hand with the manifest first: the order
    check above refuses them, naming the file checked after the manifest."""
    ckpt = single_file(save_checkpoint, 7)
    remote = upload_checkpoint(FileStorage(tmp_path / "elsewhere"), ckpt.path)
    store.put_bytes(manifest_key(7), remote.to_json(), if_absent=True)
    for entry, local_entry in zip(remote.files, ckpt.manifest.files, strict=True):
        key = f"{checkpoint_key(7)}/{entry.path}"
        store.put_file(key, ckpt.path / local_entry.path, sha256=entry.sha256)
        store.head(key)
    with pytest.raises(AssertionError, match=r"^checkpoints/step_000007/up-runner-\w+/state\.pt"):
        assert_payload_then_manifest(store, remote)
