"""One contract for every storage backend: the same tests run against file:// and against a
real SeaweedFS S3 server (configured only through the standard AWS environment)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from runner.errors import (
    IntegrityError,
    StorageConflictError,
    StorageError,
    StorageNotFoundError,
    StoragePermanentError,
)
from runner.storage import Storage
from runner.storage.file import FileStorage
from runner.storage.retry import RetryPolicy
from runner.storage.s3 import S3Storage
from runner.storage.s3_transfer import MiB
from tests.fixtures.s3 import SMALL_PARTS, SeaweedS3


@pytest.fixture
def storage(any_storage: Storage) -> Storage:
    return any_storage


def write_random(path: Path, size: int) -> str:
    data = os.urandom(size)
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("size", [0, 1000, 11 * MiB + 7])
def test_put_get_file_round_trip(storage: Storage, tmp_path: Path, size: int) -> None:
    src = tmp_path / "src.bin"
    digest = write_random(src, size)
    moved: list[int] = []
    storage.put_file("checkpoints/step_000001/state.pt", src, sha256=digest, progress=moved.append)
    assert sum(moved) == size
    assert storage.head("checkpoints/step_000001/state.pt").size == size

    dst_dir = tmp_path / "out"
    dst_dir.mkdir()
    dst = dst_dir / "state.pt"
    storage.get_file("checkpoints/step_000001/state.pt", dst)
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in dst_dir.iterdir()) == ["state.pt"]  # no temp left over


@pytest.mark.slow
def test_put_file_refuses_a_file_that_does_not_match_its_sha(
    storage: Storage, tmp_path: Path
) -> None:
    src = tmp_path / "src.bin"
    write_random(src, 4096)
    with pytest.raises(IntegrityError, match="sha256"):
        storage.put_file("a/state.pt", src, sha256="0" * 64)
    with pytest.raises(StorageNotFoundError):
        storage.head("a/state.pt")


@pytest.mark.slow
def test_bytes_list_head_delete(storage: Storage) -> None:
    storage.put_bytes("checkpoints/step_000002/manifest.json", b"{}")
    storage.put_bytes("checkpoints/step_000002/w/state.pt", b"x" * 10)
    storage.put_bytes("checkpoints/step_000010/manifest.json", b"[]")
    storage.put_bytes("loss.jsonl", b"1\n")

    listed = {(o.key, o.size) for o in storage.list("checkpoints/")}
    assert listed == {
        ("checkpoints/step_000002/manifest.json", 2),
        ("checkpoints/step_000002/w/state.pt", 10),
        ("checkpoints/step_000010/manifest.json", 2),
    }
    assert {o.key for o in storage.list()} == {k for k, _ in listed} | {"loss.jsonl"}
    assert storage.get_bytes("checkpoints/step_000010/manifest.json") == b"[]"
    with storage.open_read("checkpoints/step_000002/w/state.pt") as f:
        assert f.read(4) == b"xxxx"
        assert f.read() == b"x" * 6

    storage.delete("checkpoints/step_000002/w/state.pt")
    storage.delete("checkpoints/step_000002/w/state.pt")  # absent: not an error
    with pytest.raises(StorageNotFoundError):
        storage.head("checkpoints/step_000002/w/state.pt")
    assert {o.key for o in storage.list("checkpoints/step_000002/")} == {
        "checkpoints/step_000002/manifest.json"
    }


def test_missing_objects_are_not_found(storage: Storage, tmp_path: Path) -> None:
    with pytest.raises(StorageNotFoundError):
        storage.head("nope/manifest.json")
    with pytest.raises(StorageNotFoundError):
        storage.get_bytes("nope/manifest.json")
    with pytest.raises(StorageNotFoundError):
        storage.get_file("nope/manifest.json", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    assert list(storage.list("nope/")) == []


@pytest.mark.slow
def test_create_only_put_keeps_the_first_writer(storage: Storage) -> None:
    storage.put_bytes("checkpoints/step_000003/manifest.json", b"first", if_absent=True)
    with pytest.raises(StorageConflictError, match="already exists"):
        storage.put_bytes("checkpoints/step_000003/manifest.json", b"second", if_absent=True)
    assert storage.get_bytes("checkpoints/step_000003/manifest.json") == b"first"
    storage.put_bytes("checkpoints/step_000003/manifest.json", b"third")
    assert storage.get_bytes("checkpoints/step_000003/manifest.json") == b"third"


@pytest.mark.slow
@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", ""])
def test_keys_cannot_escape_the_location(storage: Storage, key: str) -> None:
    with pytest.raises(StorageError, match="invalid key"):
        storage.put_bytes(key, b"x")


# -- S3 only: credentials, missing bucket, checksums, multipart hygiene -------------------


@pytest.mark.slow
@pytest.mark.e2e
def test_s3_wrong_secret_is_refused_at_once_with_a_clear_error(
    s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_env.create_bucket()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-xyz")
    slow_retries = RetryPolicy(attempts=5, initial_wait_s=5.0, max_wait_s=5.0)
    store = S3Storage.from_uri(f"s3://{bucket}/p", retry=slow_retries)
    started = time.monotonic()
    with pytest.raises(StoragePermanentError) as info:
        store.put_bytes("k", b"data")
    assert time.monotonic() - started < 4.0  # no retry of a refused key
    message = str(info.value)
    assert bucket in message and s3_env.endpoint in message
    assert "SignatureDoesNotMatch" in message
    assert "not-the-secret-xyz" not in message and s3_env.secret_key not in message


@pytest.mark.slow
@pytest.mark.e2e
def test_s3_unknown_access_key_is_refused(
    s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_env.create_bucket()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "NOSUCHKEY")
    with pytest.raises(StoragePermanentError, match="InvalidAccessKeyId") as info:
        list(S3Storage.from_uri(f"s3://{bucket}/p").list())
    assert bucket in str(info.value)


@pytest.mark.e2e
def test_s3_missing_bucket_is_permanent_and_named(s3_env: SeaweedS3) -> None:
    store = S3Storage.from_uri("s3://no-such-bucket-here/p")
    with pytest.raises(StoragePermanentError, match="no-such-bucket-here") as info:
        store.get_bytes("checkpoints/step_000001/manifest.json")
    assert "does not exist" in str(info.value)


@pytest.mark.slow
@pytest.mark.e2e
def test_s3_server_side_sha256_is_checked_and_no_upload_is_left_open(
    s3_env: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_env.create_bucket()
    store = S3Storage.from_uri(f"s3://{bucket}/runs/r1", settings=SMALL_PARTS)
    src = tmp_path / "big.bin"
    digest = write_random(src, 11 * MiB)
    store.put_file("checkpoints/step_000001/state.pt", src, sha256=digest)
    # SeaweedFS returns SHA-256 checksums: the composite of 3 parts was compared
    assert store.server_checksums is True
    head = s3_env.client().head_object(
        Bucket=bucket, Key="runs/r1/checkpoints/step_000001/state.pt", ChecksumMode="ENABLED"
    )
    assert head["ChecksumSHA256"].endswith("-3")
    assert store.list_incomplete_uploads() == ()


def test_file_storage_lists_no_temp_files(tmp_path: Path) -> None:
    store = FileStorage(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step_000001-abc").mkdir()
    (tmp_path / "checkpoints" / ".tmp-step_000001-abc" / "state.pt").write_bytes(b"x")
    store.put_bytes("checkpoints/step_000001/manifest.json", b"{}")
    assert [o.key for o in store.list()] == ["checkpoints/step_000001/manifest.json"]


@pytest.mark.slow
def test_s3_tests_fail_rather_than_skip_without_the_server(tmp_path: Path) -> None:
    """Without `weed` on PATH the S3 tests must fail, so CI cannot pass them silently."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "s3_missing_bucket"],
        env={**os.environ, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 1, result.stdout
    assert "`weed` not found" in result.stdout
    assert "1 error" in result.stdout and "skipped" not in result.stdout


def _damaged(data: bytes, how: str) -> bytes:
    part = SMALL_PARTS.part_size  # the ranges the S3 download fetches concurrently
    if how == "corrupt-chunk":
        at = part + 3
        return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
    if how == "truncated":
        return data[:-1]
    assert how == "swapped-parts"
    return data[part : 2 * part] + data[:part] + data[2 * part :]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["corrupt-chunk", "truncated", "swapped-parts"])
def test_a_damaged_object_is_refused_and_leaves_nothing(
    storage: Storage, tmp_path: Path, how: str
) -> None:
    """The stored bytes differ from what the manifest promised: get_file raises
    IntegrityError (truncation named as such) and no file is left, temp or final."""
    data = os.urandom(11 * MiB + 7)
    src = tmp_path / "src.bin"
    src.write_bytes(_damaged(data, how))
    storage.put_file("checkpoints/step_000001/state.pt", src)
    out = tmp_path / "out"
    out.mkdir()
    expect = "truncated" if how == "truncated" else "sha256 differs"
    with pytest.raises(IntegrityError, match=expect):
        storage.get_file(
            "checkpoints/step_000001/state.pt",
            out / "state.pt",
            sha256=hashlib.sha256(data).hexdigest(),
            size=len(data),
        )
    assert list(out.iterdir()) == []
