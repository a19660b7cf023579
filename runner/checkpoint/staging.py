"""Staging: one checkpoint being assembled in its own temp directory. Every payload file goes
through a hashing writer, so the manifest's entries come from the same pass that wrote the bytes.
Format modules (runner.checkpoint.formats) write into a Staging; the writer commits it."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

from runner.atomicity.files import HashingFileWriter, fsync_file, read_chunks, sha256_file
from runner.checkpoint.manifest import FileEntry


class Staging:
    """One checkpoint being assembled in its own temp directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: list[FileEntry] = []

    @contextmanager
    def open_file(self, name: str) -> Iterator[HashingFileWriter]:
        """A hashing writer for one payload file; recorded in the manifest on success."""
        final = self.path / name
        final.parent.mkdir(parents=True, exist_ok=True)
        with HashingFileWriter(final) as out:
            yield out
            out.commit(sync_dir=False)  # the staging dir is fsynced once, before the rename
        self.files.append(FileEntry(path=name, size=out.size, sha256=out.sha256))

    def write_torch(self, name: str, obj: Any) -> FileEntry:
        import torch  # imported here so listing/verifying commands start fast

        with self.open_file(name) as out, _without_zip_crc32():
            # torch.save only calls write() and flush(): no seek, so it streams one pass
            try:
                torch.save(obj, cast(BinaryIO, out))
            except RuntimeError as exc:
                # torch's zip writer hides a failed write (ENOSPC, EIO) behind its own
                # RuntimeError when it closes the archive; surface the OS error itself.
                raise _os_error_in_chain(exc) or exc from None
        return self.files[-1]

    def write_bytes(self, name: str, data: bytes) -> FileEntry:
        with self.open_file(name) as out:
            out.write(data)
        return self.files[-1]

    def copy_in(self, name: str, src: Path) -> FileEntry:
        """Copy a file in, hashing it in the same single read."""
        with open(src, "rb") as f, self.open_file(name) as out:
            for chunk in read_chunks(f):
                out.write(chunk)
        return self.files[-1]

    def move_in(self, name: str, src: Path, *, digest: tuple[int, str] | None = None) -> FileEntry:
        """Rename a file in (same filesystem), hash it in one read unless the caller has, and
        fsync it."""
        final = self.path / name
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(src, final)
        size, sha256 = digest or sha256_file(final)
        fsync_file(final)
        self.files.append(FileEntry(path=name, size=size, sha256=sha256))
        return self.files[-1]


def _os_error_in_chain(exc: BaseException) -> OSError | None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class _ZipCrc32Off:
    """torch.save computes a zip CRC32 of every byte, single-threaded: it costs more than the
    write itself. The manifest's sha256 already covers every byte, so CRC32 is switched off
    while our saves run (torch.load reads such files; a save by another thread meanwhile merely
    skips it too). Counted, so overlapping saves in several threads restore the setting once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._previous = True

    @contextmanager
    def __call__(self) -> Iterator[None]:
        from torch.utils.serialization import config

        with self._lock:
            if self._active == 0:
                self._previous = config.save.compute_crc32
                config.save.compute_crc32 = False
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    config.save.compute_crc32 = self._previous


_without_zip_crc32 = _ZipCrc32Off()
