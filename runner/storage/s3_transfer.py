"""How s3:// moves large objects: the transfer settings (part size, concurrency, socket
timeouts sized from the store timeout), progress subscribers, and the checksum an upload's
server should report, computed in the one read of the local file that also checks its sha256.
"""

from __future__ import annotations

import base64
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from s3transfer.manager import TransferConfig
from s3transfer.subscribers import BaseSubscriber
from s3transfer.utils import ChunksizeAdjuster

from runner.atomicity.files import CHUNK
from runner.errors import ConfigError, IntegrityError
from runner.storage.base import ProgressCallback

MiB = 1024 * 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferSettings:
    """How large objects are split and how many parts move at once."""

    part_size: int = 16 * MiB
    multipart_threshold: int = 16 * MiB
    concurrency: int = 8
    request_attempts: int = 3
    """Tries of one HTTP request inside botocore (a dropped part is resent alone)."""
    connect_timeout_s: float = 10.0
    """Also bounds each blocked socket send (urllib3 sends the body under it)."""
    read_timeout_s: float = 10.0
    """Per socket read, not per object: a long transfer that keeps moving never hits it. It
    also covers the wait for an answer after a part was handed to the kernel, which on a
    slow link includes draining the socket's send buffer (up to a few MiB)."""
    download_attempts: int = 2
    """Tries of one ranged GET inside s3transfer when its body stream breaks off."""

    def __post_init__(self) -> None:
        if self.part_size < 5 * MiB:
            raise ConfigError("S3 part size must be >= 5 MiB (the S3 minimum)")
        if self.concurrency < 1 or self.request_attempts < 1 or self.download_attempts < 1:
            raise ConfigError("S3 concurrency and request/download attempts must be >= 1")

    @classmethod
    def for_store_timeout(cls, seconds: float) -> TransferSettings:
        """Socket timeouts sized so that one request, botocore's own retries included, takes
        about half the store timeout at most against a store that never answers; never
        above 10 s to connect and 20 s per read, nor below 2 s to connect and 1 s per read
        unless the store timeout itself is shorter. Below 9 s the socket floors leave no
        room for 3 botocore tries: then as many as fit (2, else 1), so that one request
        (`request_worst_s`) still ends within the store timeout."""
        share = seconds / (2 * 3)
        connect = min(10.0, max(min(2.0, seconds), share))
        read = min(20.0, max(min(1.0, seconds), share))
        for attempts in (3, 2, 1):
            settings = cls(
                connect_timeout_s=connect, read_timeout_s=read, request_attempts=attempts
            )
            if settings.request_worst_s() <= seconds:
                break
        return settings

    def request_worst_s(self) -> float:
        """Longest one request can take against a store that accepts and never answers (or
        never accepts): every botocore try times out, plus botocore's backoff between them
        (standard mode: up to 2**(n-1) s before try n+1, at most 20 s)."""
        backoff = sum(min(20.0, 2.0 ** (n - 1)) for n in range(1, self.request_attempts))
        timeout = max(self.connect_timeout_s, self.read_timeout_s)
        return self.request_attempts * timeout + backoff

    def transfer_config(self) -> TransferConfig:
        return TransferConfig(
            multipart_threshold=self.multipart_threshold,
            multipart_chunksize=self.part_size,
            max_request_concurrency=self.concurrency,
            num_download_attempts=self.download_attempts,
        )


class Moved:
    """When a transfer last moved a byte (time.monotonic()), for the store-timeout budget."""

    def __init__(self) -> None:
        self._at: float | None = None

    def touch(self, _bytes: int) -> None:
        self._at = time.monotonic()

    def at(self) -> float | None:
        return self._at


class Progress(BaseSubscriber):
    def __init__(self, callback: ProgressCallback) -> None:
        self._callback = callback

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._callback(bytes_transferred)


def expected_checksum(src: Path, *, size: int, sha256: str, settings: TransferSettings) -> str:
    """Check the file still has the manifest's sha256 and return the SHA-256 checksum
    the server should report: the full digest for one PUT, the composite of part
    digests ("<b64>-<parts>") for a multipart upload. One read of the file; the part
    digests are computed on a second core (hashlib releases the GIL)."""
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
    if full.hexdigest() != sha256:
        raise IntegrityError(
            f"{src} no longer matches its manifest (sha256 {full.hexdigest()[:12]}... "
            f"!= {sha256[:12]}...); not uploading a corrupt file"
        )
    if not multipart:
        return base64.b64encode(full.digest()).decode()
    composite = hashlib.sha256(b"".join(parts)).digest()
    return f"{base64.b64encode(composite).decode()}-{len(parts)}"
