"""Upload integrity for s3://: the SHA-256 checksum the server should report, computed in the
one read of the local file that also checks its sha256, and the check of the stored object's
size and checksum after the upload.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from s3transfer.utils import ChunksizeAdjuster

from runner.atomicity.files import CHUNK
from runner.errors import IntegrityError, StorageTransientError
from runner.storage.s3_transfer import TransferSettings

# the S3Storage logger: these messages kept their name when they left runner.storage.s3
log = logging.getLogger("runner.storage.s3")


def expected_checksum(
    src: Path,
    *,
    size: int,
    sha256: str,
    settings: TransferSettings,
    on_part: Callable[[int, bytes], None] | None = None,
) -> str:
    """Check the file still has the manifest's sha256 and return the SHA-256 checksum
    the server should report: the full digest for one PUT, the composite of part
    digests ("<b64>-<parts>") for a multipart upload. One read of the file; the part
    digests are computed on a second core (hashlib releases the GIL), each handed to
    `on_part(length, digest)` as soon as it is known (runner.storage.s3_parts)."""
    multipart = size >= settings.multipart_threshold
    part_size = ChunksizeAdjuster().adjust_chunksize(settings.part_size, size)
    full = hashlib.sha256()
    parts: list[bytes] = []
    with open(src, "rb") as f, ThreadPoolExecutor(1, "part-digests") as helper:
        while True:
            part = hashlib.sha256()
            remaining = part_size if multipart else size
            while remaining:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    break
                pending = helper.submit(part.update, chunk) if multipart else None
                full.update(chunk)
                if pending is not None:
                    pending.result()
                remaining -= len(chunk)
            if not multipart or remaining == part_size:
                break
            parts.append(part.digest())
            if on_part is not None:
                on_part(part_size - remaining, parts[-1])
    if full.hexdigest() != sha256:
        raise IntegrityError(
            f"{src} no longer matches its manifest (sha256 {full.hexdigest()[:12]}... "
            f"!= {sha256[:12]}...); not uploading a corrupt file"
        )
    if not multipart:
        return base64.b64encode(full.digest()).decode()
    composite = hashlib.sha256(b"".join(parts)).digest()
    return f"{base64.b64encode(composite).decode()}-{len(parts)}"


class UploadCheck:
    """Checks an upload against the HEAD that follows it, and remembers whether the store
    reports SHA-256 checksums (None until the first verified upload tells)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.server_checksums: bool | None = None

    def check(
        self, head: Mapping[str, Any], *, where: str, size: int, expected: str | None
    ) -> None:
        """StorageTransientError (upload again) when the stored size differs, or when the
        server's checksum differs from expected; stores that report none get the size check."""
        if head["ContentLength"] != size:
            raise StorageTransientError(
                f"{where}: stored size {head['ContentLength']} != {size}; re-uploading"
            )
        if expected is None:
            return
        reported = head.get("ChecksumSHA256")
        if reported is None:
            if self.server_checksums is not False:
                log.info(
                    "%s does not report SHA-256 checksums: uploads are checked by size, and "
                    "the manifest's sha256 is verified on download",
                    self.endpoint,
                )
            self.server_checksums = False
            return
        self.server_checksums = True
        if reported != expected:
            raise StorageTransientError(
                f"{where}: server checksum {reported} != local {expected}; re-uploading"
            )
