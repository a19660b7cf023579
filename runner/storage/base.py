"""The storage protocol every backend implements (file:// and s3://).

Keys are '/'-separated, relative to the location root (a run dir or a bucket prefix), and
never start with '/'. Backends translate their own failures into StorageNotFoundError,
StorageTransientError (retry) or StoragePermanentError (do not retry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from runner.errors import IntegrityError, StorageError


def check_key(key: str, *, uri: str) -> str:
    """Refuse keys that are empty, absolute or contain empty, '.' or '..' parts: a key must
    name an object under the location root, never outside it."""
    if not key or key.startswith("/") or any(part in ("", ".", "..") for part in key.split("/")):
        raise StorageError(f"invalid key {key!r} for {uri}")
    return key


def check_download(
    where: str,
    *,
    got_size: int,
    got_sha256: str,
    size: int | None,
    sha256: str | None,
) -> None:
    """Compare a downloaded stream with what the manifest promised (None: not checked).
    Size first: a truncated copy is reported as truncated, not as a hash mismatch."""
    if size is not None and got_size != size:
        raise IntegrityError(
            f"{where}: {got_size} bytes stored, the manifest says {size} (the stored copy is "
            "truncated or replaced)"
        )
    if sha256 is not None and got_sha256 != sha256:
        raise IntegrityError(
            f"{where}: sha256 differs from the manifest (the stored copy is corrupt)"
        )


# Called with the number of bytes moved since the previous call.
ProgressCallback = Callable[[int], None]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified: float | None = None  # unix seconds; None where the backend does not say


class Storage(Protocol):
    @property
    def uri(self) -> str:
        """Where this storage points, for messages (never contains secrets)."""
        ...

    def local_path(self, key: str = "") -> Path | None:
        """Where `key` (the location's root for "") lies on this machine, when the storage is
        a plain directory here: a caller may then work on it in place (verify a step dir on
        several threads, rename it away whole). None for a store reached through requests
        (s3://), and for a storage whose every call must go through its methods (a wrapper
        that records them). Nothing is checked: the path may not exist."""
        ...

    def put_file(
        self,
        key: str,
        src: Path,
        *,
        sha256: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Upload a local file. When sha256 is given the backend verifies it (server-side
        checksum where supported) and raises IntegrityError on mismatch."""
        ...

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        """Write a small object. With if_absent, raise StorageConflictError instead of
        replacing an existing object (atomic where the backend allows)."""
        ...

    def get_file(
        self,
        key: str,
        dst: Path,
        *,
        progress: ProgressCallback | None = None,
        sha256: str | None = None,
        size: int | None = None,
    ) -> None:
        """Download to dst atomically (temp file in dst's directory, fsync, rename). When
        size / sha256 are given they are checked in the same pass (size first, so a truncated
        copy is reported as such); a mismatch raises IntegrityError and leaves nothing at
        dst."""
        ...

    def get_bytes(self, key: str) -> bytes: ...

    def open_read(self, key: str) -> BinaryIO:
        """A streaming reader, for verifying without a local copy."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with prefix (recursive), in no particular order."""
        ...

    def head(self, key: str) -> ObjectInfo:
        """Size of one object; StorageNotFoundError if absent."""
        ...

    def delete(self, key: str) -> None:
        """Remove one object; absent objects are not an error."""
        ...

    def close(self) -> None:
        """Release what the storage keeps between calls (an S3 storage's transfer threads).
        It stays usable; a transfer still running on another thread is not waited for."""
        ...
