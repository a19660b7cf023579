"""How s3:// moves large objects: the transfer settings (part size, concurrency, socket
timeouts sized from the store timeout) and the progress subscribers of a transfer. The
upload checksum is in runner.storage.s3_checksum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from s3transfer.manager import TransferConfig
from s3transfer.subscribers import BaseSubscriber

from runner.errors import ConfigError
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
