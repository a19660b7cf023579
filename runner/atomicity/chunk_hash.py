"""A sha256 per fixed-size chunk of a file, computed in the pass that writes it.

One sha256 cannot be split across cores, so verifying a large file against its whole-file
digest is one core's work (~1.8 GB/s here): slower than a disk or the page cache delivers.
Digests of its 64 MiB chunks let a reader check the chunks on every core at once
(runner.checkpoint.verify); the whole-file sha256 stays, for older runners and the mirror.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Big enough that a chunk's hashing dwarfs its scheduling and its read stays sequential,
# small enough that a 1 GB file already spreads over 16 chunks (a core each, up to 8).
CHUNK_DIGEST_BYTES = 64 * 1024 * 1024
_READ = 8 * 1024 * 1024


class ChunkHasher:
    """The sha256 of every `chunk_bytes` of a byte stream fed in order through `update`."""

    def __init__(self, chunk_bytes: int | None = None) -> None:
        # read at call time, so a test can make the chunks small
        self.chunk_bytes = CHUNK_DIGEST_BYTES if chunk_bytes is None else chunk_bytes
        self._current = hashlib.sha256()
        self._filled = 0
        self._digests: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")  # slices below must count bytes
        while view.nbytes:
            take = min(view.nbytes, self.chunk_bytes - self._filled)
            self._current.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self._close_chunk()

    def digests(self) -> list[str] | None:
        """Every chunk's digest (the last one may be short); None for a file of one chunk or
        less, whose whole-file sha256 already is its only chunk's."""
        if self._filled:
            self._close_chunk()
        return self._digests if len(self._digests) > 1 else None

    def _close_chunk(self) -> None:
        self._digests.append(self._current.hexdigest())
        self._current = hashlib.sha256()
        self._filled = 0


def hash_file_chunks(path: Path) -> tuple[int, str, list[str] | None]:
    """(size, sha256, chunk digests) of a file in one read: the whole-file and the chunk
    digests are computed side by side on two threads (sha256 releases the GIL)."""
    whole = hashlib.sha256()
    chunks = ChunkHasher()
    size = 0
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(max_workers=1) as pool:
        while data := f.read(_READ):
            beside = pool.submit(chunks.update, data)
            whole.update(data)
            beside.result()
            size += len(data)
    return size, whole.hexdigest(), chunks.digests()
