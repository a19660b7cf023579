"""Atomic file primitives: stream to a unique temp name beside the target, hash in the same
pass, fsync, rename, fsync the directory. A crash at any instant leaves either the old file
or the complete new one under the final name, never a partial one."""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from runner.atomicity.chunk_hash import ChunkHasher
from runner.atomicity.temp import temp_path

CHUNK = 8 * 1024 * 1024
# Writes at least this big are hashed on a helper thread while the caller writes them to the
# file: sha256 and write() both release the GIL, so a large save costs max(hash, write)
# instead of their sum. Smaller writes (pickle headers) are not worth the hand-off.
PARALLEL_HASH_MIN = 1024 * 1024
# Ask the kernel to start writing back every this many bytes while the rest is still being
# produced: the final fsync then waits for the tail only, so disk time overlaps the hashing
# and serialising instead of following them (a plain write+fsync leaves it all to the end).
WRITEBACK_EVERY = 32 * 1024 * 1024
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages, do not wait


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Hint: begin writing this range to disk now. Best effort; durability still comes from
    fsync in commit(), so any failure here is ignored (unsupported filesystem, old libc)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


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


class HashingFileWriter:
    """A write-only binary file that computes sha256 and size as bytes go by.

    Use as a context manager: on success `commit()` fsyncs and renames into place; on error
    or without commit the temp file is removed. `chunked=True` also computes the sha256 of
    every chunk (runner.atomicity.chunk_hash), beside the whole-file one: `chunk_digests`
    after commit (None for a file of one chunk).
    """

    def __init__(self, final: Path, *, parallel_hash: bool = True, chunked: bool = False) -> None:
        self.final = final
        self.temp = temp_path(final)
        self._file: BinaryIO = open(self.temp, "xb")  # noqa: SIM115 - closed in commit/abort
        self._hash = hashlib.sha256()
        self._chunks = ChunkHasher() if chunked else None
        self._parallel = parallel_hash
        self._pool: ThreadPoolExecutor | None = None
        self.size = 0
        self.sha256 = ""
        self.chunk_digests: list[str] | None = None
        self._writeback_from = 0

    # file-like surface, enough for torch.save and shutil.copyfileobj
    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        if self._parallel and view.nbytes >= PARALLEL_HASH_MIN:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sha256")
            # The caller may reuse its buffer once write() returns, so wait for all.
            hashed = [self._pool.submit(self._hash.update, view)]
            if self._chunks is not None:
                hashed.append(self._pool.submit(self._chunks.update, view))
            try:
                self._file.write(view)
            finally:
                for done in hashed:
                    done.result()
        else:
            self._file.write(view)
            self._hash.update(view)
            if self._chunks is not None:
                self._chunks.update(view)
        self.size += view.nbytes
        if self.size - self._writeback_from >= WRITEBACK_EVERY:
            # A few KiB may still sit in the BufferedWriter (large writes bypass it); they
            # are not dirty yet, and the final fsync covers them.
            start_writeback(
                self._file.fileno(), self._writeback_from, self.size - self._writeback_from
            )
            self._writeback_from = self.size
        return view.nbytes

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        # write-only from offset 0: the position is the bytes written (torch DCP asks for it)
        return self.size

    def fileno(self) -> int:
        return self._file.fileno()

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
        if self._chunks is not None:
            self.chunk_digests = self._chunks.digests()

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


def hash_range(stream: BinaryIO, offset: int, nbytes: int) -> tuple[int, str]:
    """(bytes read, sha256) of `nbytes` of a seekable stream from `offset`: fewer bytes read
    means the file ended first. One thread, one sequential read: callers hash several ranges
    at once, each on its own stream."""
    digest = hashlib.sha256()
    stream.seek(offset)
    got = 0
    while got < nbytes and (data := stream.read(min(CHUNK, nbytes - got))):
        digest.update(data)
        got += len(data)
    return got, digest.hexdigest()


def sha256_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, read once in large chunks."""
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f)
