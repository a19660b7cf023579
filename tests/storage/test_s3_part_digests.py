"""Each multipart part goes with the SHA-256 that the local hash pass computed (the pass that
checks the file against its manifest), not one botocore computes from a third read: the
header is in the request before botocore's own checksum step, it is the digest of that part's
bytes, and the real server refuses a part whose bytes are not the ones that were hashed."""

from __future__ import annotations

import base64
import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest

from runner.storage.s3 import S3Storage
from runner.storage.s3_parts import PartChecksums
from tests.fixtures.s3 import (
    SMALL_PARTS,
    SeaweedS3,
    b64_sha256,
    small_parts_store,
    three_part_payload,
)

PART = SMALL_PARTS.part_size


def _assert_reads_back(store: S3Storage, tmp_path: Path, data: bytes) -> None:
    got = tmp_path / "back.bin"
    store.get_file("payload.bin", got)
    assert got.read_bytes() == data
    store.close()


class _Body:
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def _params(number: int, length: int, key: str = "k") -> dict[str, Any]:
    return {"Bucket": "b", "Key": key, "PartNumber": number, "Body": _Body(length)}


def test_a_part_gets_the_digest_of_the_hash_pass_once_it_is_known() -> None:
    checksums = PartChecksums()
    with checksums.track("b", "k") as digests:
        params = _params(2, 7)
        waiter = threading.Thread(target=checksums.supply, args=(params,))
        waiter.start()
        digests.add(5, b"\x01" * 32)
        waiter.join(0.2)
        assert waiter.is_alive()  # part 2 is not hashed yet: its request waits
        digests.add(7, b"\x02" * 32)
        waiter.join(5)
        assert not waiter.is_alive()
        assert params["ChecksumSHA256"] == base64.b64encode(b"\x02" * 32).decode()


def test_a_part_without_a_known_digest_is_left_to_botocore() -> None:
    checksums = PartChecksums()
    untracked = _params(1, 5, key="other")
    with checksums.track("b", "k") as digests:
        digests.add(5, b"\x01" * 32)
        checksums.supply(untracked)
        wrong_length = _params(1, 6)
        checksums.supply(wrong_length)  # not the bytes that were hashed
        digests.end()
        after_the_pass = _params(2, 5)
        checksums.supply(after_the_pass)  # the pass ended without part 2: no wait
        with checksums.track("b", "k"):
            two_at_once = _params(1, 5)
            checksums.supply(two_at_once)  # which upload it belongs to is not known
    for params in (untracked, wrong_length, after_the_pass, two_at_once):
        assert "ChecksumSHA256" not in params


@pytest.mark.e2e
def test_each_part_carries_the_hash_pass_digest_before_botocore_hashes(
    s3_env: SeaweedS3, tmp_path: Path
) -> None:
    store = small_parts_store(s3_env)
    src, data = three_part_payload(tmp_path)
    given: dict[int, str | None] = {}

    def record(params: dict[str, Any], **_: Any) -> None:
        # before-call comes before botocore computes a checksum of its own
        number = int(params["query_string"]["partNumber"])
        given[number] = params["headers"].get("x-amz-checksum-sha256")

    store._client.meta.events.register("before-call.s3.UploadPart", record)
    store.put_file("payload.bin", src, sha256=hashlib.sha256(data).hexdigest())
    assert given == {n: b64_sha256(data[(n - 1) * PART : n * PART]) for n in (1, 2, 3)}
    _assert_reads_back(store, tmp_path, data)


@pytest.mark.e2e
def test_a_part_changed_after_it_was_hashed_is_refused_by_the_server_and_resent(
    s3_env: SeaweedS3, tmp_path: Path
) -> None:
    store = small_parts_store(s3_env)
    src, data = three_part_payload(tmp_path)
    answers: list[tuple[int, str | None]] = []
    changed = threading.Event()

    def change_once(params: dict[str, Any], **_: Any) -> None:
        # the file changes after the hash pass read part 2 and before the part is sent
        if int(params["query_string"]["partNumber"]) == 2 and not changed.is_set():
            changed.set()
            with open(src, "r+b") as f:
                f.seek(PART + 1000)
                f.write(bytes([data[PART + 1000] ^ 0x01]))

    def answer(http_response: Any, parsed: dict[str, Any], **_: Any) -> None:
        code = parsed.get("Error", {}).get("Code")
        answers.append((http_response.status_code, code))
        if code is not None:
            src.write_bytes(data)  # back as it was hashed: the retry sends the right bytes

    store._client.meta.events.register("before-call.s3.UploadPart", change_once)
    store._client.meta.events.register("after-call.s3.UploadPart", answer)
    store.put_file("payload.bin", src, sha256=hashlib.sha256(data).hexdigest())
    refused = [(status, code) for status, code in answers if code is not None]
    assert refused == [(400, "BadDigest")]
    _assert_reads_back(store, tmp_path, data)
