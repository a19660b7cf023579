"""Atomic file primitives: stream to a unique temp name beside the target, hash in the same
pass, fsync, rename, fsync the directory. A crash at any instant leaves either the old file
or the complete new one under the final name, never a partial one."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from runner.checkpoint.layout import TMP_PREFIX

CHUNK = 8 * 1024 * 1024
# Writes at least this big are hashed on a helper thread while the caller writes them to the
# file: sha256 and write() both release the GIL, so a large save costs max(hash, write)
# instead of their sum. Smaller writes (pickle headers) are not worth the hand-off.
PARALLEL_HASH_MIN = 1024 * 1024


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(final: Path) -> Path:
    """Unique temp name in the same directory (same filesystem, so rename is atomic)."""
    return final.with_name(f"{TMP_PREFIX}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:12]}")


class HashingFileWriter:
    """A write-only binary file that computes sha256 and size as bytes go by.

    Use as a context manager: on success `commit()` fsyncs and renames into place; on error
    or without commit the temp file is removed.
    """

    def __init__(self, final: Path, *, parallel_hash: bool = True) -> None:
        self.final = final
        self.temp = temp_path_for(final)
        self._file: BinaryIO = open(self.temp, "xb")  # noqa: SIM115 - closed in commit/abort
        self._hash = hashlib.sha256()
        self._parallel = parallel_hash
        self._pool: ThreadPoolExecutor | None = None
        self.size = 0
        self.sha256 = ""

    # file-like surface, enough for torch.save and shutil.copyfileobj
    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        if self._parallel and view.nbytes >= PARALLEL_HASH_MIN:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256")
            # The caller may reuse its buffer once write() returns, so wait for both.
            hashed = self._pool.submit(self._hash.update, view)
            try:
                self._file.write(view)
            finally:
                hashed.result()
        else:
            self._file.write(view)
            self._hash.update(view)
        self.size += view.nbytes
        return view.nbytes

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self._file.flush()

    def digest_so_far(self) -> str:
        return self._hash.hexdigest()

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def commit(self, *, sync_dir: bool = True) -> None:
        self._stop_pool()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.temp, self.final)
        if sync_dir:
            fsync_dir(self.final.parent)
        self.sha256 = self._hash.hexdigest()

    def abort(self) -> None:
        self._stop_pool()
        if not self._file.closed:
            self._file.close()
        self.temp.unlink(missing_ok=True)

    def __enter__(self) -> HashingFileWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None or not self.final.exists() or self.temp.exists():
            self.abort()


def atomic_write_chunks(final: Path, chunks: Iterable[bytes]) -> tuple[int, str]:
    """Write chunks atomically to final; returns (size, sha256)."""
    with HashingFileWriter(final) as writer:
        for chunk in chunks:
            writer.write(chunk)
        writer.commit()
    return writer.size, writer.sha256


def atomic_write_bytes(final: Path, data: bytes) -> tuple[int, str]:
    return atomic_write_chunks(final, [data])


def read_chunks(stream: BinaryIO, chunk_size: int = CHUNK) -> Iterable[bytes]:
    while chunk := stream.read(chunk_size):
        yield chunk


def hash_stream(stream: BinaryIO, chunk_size: int = CHUNK) -> tuple[int, str]:
    """(size, sha256) of a stream, reading the next chunk while hashing this one.

    Reading (disk, network) and sha256 both release the GIL, so verifying a cold file costs
    about max(read, hash) instead of their sum."""
    digest = hashlib.sha256()
    size = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-ahead") as pool:
        pending = pool.submit(stream.read, chunk_size)
        while chunk := pending.result():
            pending = pool.submit(stream.read, chunk_size)
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def sha256_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, read once in large chunks."""
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f)
