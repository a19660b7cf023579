"""The SHA-256 of each multipart part, handed to its UploadPart request as it is computed.

The local hash pass (runner.storage.s3_checksum.expected_checksum) already computes every
part's digest. Given as the request's `ChecksumSHA256`, botocore sends it instead of hashing
the part a third time, and the store refuses a part whose bytes differ from it (BadDigest):
what is stored is then exactly what the hash pass read, whose whole-file sha256 is checked
against the manifest. A part for which no digest is known (another upload of the same key in
flight, a length that differs from the one hashed, a hash pass that ended early) is left to
botocore, which computes its own as before.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

UPLOAD_PART_EVENT = "before-parameter-build.s3.UploadPart"


class PartDigests:
    """The digests of one upload's parts, in order, as the hash pass finishes each one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._parts: list[tuple[int, bytes]] = []  # (length, sha256 digest) of part 1, 2, ...
        self._ended = False

    def add(self, length: int, digest: bytes) -> None:
        with self._cond:
            self._parts.append((length, digest))
            self._cond.notify_all()

    def end(self) -> None:
        """No more parts come (the pass finished or failed): waiters stop waiting."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wait(self, number: int) -> tuple[int, bytes] | None:
        """Part `number` (from 1) once hashed; None if the pass ends without it."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._parts) >= number or self._ended)
            return self._parts[number - 1] if len(self._parts) >= number else None


class PartChecksums:
    """The uploads of one client whose parts get their digest from the hash pass: register
    `supply` for UPLOAD_PART_EVENT on the client, and run each upload inside `track`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._uploads: dict[tuple[str, str], list[PartDigests]] = {}

    @contextmanager
    def track(self, bucket: str, key: str) -> Iterator[PartDigests]:
        digests = PartDigests()
        with self._lock:
            self._uploads.setdefault((bucket, key), []).append(digests)
        try:
            yield digests
        finally:
            digests.end()
            with self._lock:
                tracked = self._uploads[(bucket, key)]
                tracked.remove(digests)
                if not tracked:
                    del self._uploads[(bucket, key)]

    def supply(self, params: dict[str, Any], **_: Any) -> None:
        """botocore event handler: set the part's ChecksumSHA256 when its digest is known."""
        with self._lock:
            tracked = self._uploads.get((params.get("Bucket", ""), params.get("Key", "")), [])
            # two uploads of one key at once: which one this part belongs to is not known
            digests = tracked[0] if len(tracked) == 1 else None
        if digests is None or "ChecksumSHA256" in params:
            return
        part = digests.wait(int(params["PartNumber"]))
        if part is None:
            return
        length, digest = part
        body = params.get("Body")
        if body is None or _length(body) != length:
            return  # not the bytes that were hashed: botocore hashes what it sends
        params["ChecksumSHA256"] = base64.b64encode(digest).decode()


def _length(body: Any) -> int | None:
    try:
        return len(body)
    except TypeError:
        return None
