"""s3:// requests carry no SHA-256 of the body for the signature (UNSIGNED-PAYLOAD), which
botocore would otherwise compute over http:// in a second pass over every uploaded byte. The
body's integrity rests on the SHA-256 checksum header instead: every part of a multipart
upload carries the digest of its own bytes, that header is among the signed ones, and the real
server refuses a body that differs from it (the fault, a part's bytes changed after signing,
is injected through botocore's before-send event)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from runner.errors import RunnerError
from tests.fixtures.s3 import (
    SMALL_PARTS,
    SeaweedS3,
    b64_sha256,
    small_parts_store,
    three_part_payload,
)

pytestmark = pytest.mark.e2e

PART = SMALL_PARTS.part_size


def _part_number(request: Any) -> int:
    """The part an UploadPart request sends (its partNumber query parameter)."""
    return int(parse_qs(urlsplit(request.url).query)["partNumber"][0])


def test_each_part_is_sent_unsigned_with_its_own_signed_checksum(
    s3_env: SeaweedS3, tmp_path: Path
) -> None:
    store = small_parts_store(s3_env)
    src, data = three_part_payload(tmp_path)
    sent: dict[int, dict[str, str]] = {}

    def record(request: Any, **_: Any) -> None:
        sent[_part_number(request)] = {k.lower(): v.decode() if isinstance(v, bytes) else v
                        for k, v in request.headers.items()}  # fmt: skip

    store._client.meta.events.register("before-send.s3.UploadPart", record)
    store.put_file("payload.bin", src, sha256=hashlib.sha256(data).hexdigest())
    assert sorted(sent) == [1, 2, 3]
    for number, headers in sent.items():
        part = data[(number - 1) * PART : number * PART]
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert headers["x-amz-checksum-sha256"] == b64_sha256(part)
        signed = headers["authorization"].split("SignedHeaders=")[1].split(",")[0].split(";")
        assert "x-amz-checksum-sha256" in signed, signed
    got = tmp_path / "back.bin"
    store.get_file("payload.bin", got)
    assert got.read_bytes() == data
    store.close()


def test_fake_corrupted_part_a_body_changed_after_signing_is_refused_and_not_stored(
    s3_env: SeaweedS3, tmp_path: Path
) -> None:
    store = small_parts_store(s3_env)
    src, data = three_part_payload(tmp_path)

    def corrupt(request: Any, **_: Any) -> None:
        if _part_number(request) == 2:
            body = bytearray(data[PART : 2 * PART])
            body[1000] ^= 0x01
            request.body = bytes(body)

    store._client.meta.events.register("before-send.s3.UploadPart", corrupt)
    with pytest.raises(RunnerError):
        store.put_file("payload.bin", src, sha256=hashlib.sha256(data).hexdigest())
    assert [o.key for o in store.list()] == []
    store.close()
