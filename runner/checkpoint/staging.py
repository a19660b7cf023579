"""Staging: one checkpoint being assembled in its own temp directory. Every payload file goes
through a hashing writer, so the manifest's entries come from the same pass that wrote the bytes.
Format modules (runner.checkpoint.formats) write into a Staging; the writer commits it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, cast

from runner.atomicity import chunk_hash
from runner.atomicity.chunk_hash import hash_file_chunks
from runner.atomicity.files import HashingFileWriter, fsync_file, read_chunks
from runner.checkpoint.chunk_digests import chunk_field
from runner.checkpoint.manifest import FileEntry


class Staging:
    """One checkpoint being assembled in its own temp directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files: list[FileEntry] = []
        self.chunks: dict[str, list[str]] = {}
        """The chunk digests of each file of more than one chunk (runner.atomicity.chunk_hash),
        by name: the manifest lists them beside `files` (`chunk_field`)."""
        self._chunk_bytes: int | None = None

    @contextmanager
    def open_file(self, name: str) -> Iterator[HashingFileWriter]:
        """A hashing writer for one payload file; recorded in the manifest on success."""
        final = self.path / name
        final.parent.mkdir(parents=True, exist_ok=True)
        with HashingFileWriter(final, chunked=True) as out:
            yield out
            out.commit(sync_dir=False)  # the staging dir is fsynced once, before the rename
        self._record(FileEntry(path=name, size=out.size, sha256=out.sha256), out.chunk_digests)

    def chunk_field(self) -> dict[str, Any] | None:
        """The manifest's `extra` entry for the chunk digests; None when no file has any."""
        if self._chunk_bytes is None or not self.chunks:
            return None
        return chunk_field(self._chunk_bytes, self.chunks)

    def _record(self, entry: FileEntry, chunks: list[str] | None) -> None:
        self.files.append(entry)
        if chunks is not None:
            if self._chunk_bytes not in (None, chunk_hash.CHUNK_DIGEST_BYTES):
                raise RuntimeError("chunk size changed while a checkpoint was staged")
            self._chunk_bytes = chunk_hash.CHUNK_DIGEST_BYTES
            self.chunks[entry.path] = chunks

    def write_torch(self, name: str, obj: Any) -> FileEntry:
        with self.open_file(name) as out:
            # torch.save only calls write() and flush(): no seek, so it streams one pass
            try:
                _save_without_crc32(obj, cast(BinaryIO, out))
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
        # a caller's digest has no chunks: that file is verified by its sha256 alone
        size, sha256, chunks = (*digest, None) if digest else hash_file_chunks(final)
        fsync_file(final)
        self._record(FileEntry(path=name, size=size, sha256=sha256), chunks)
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


def _save_without_crc32(obj: Any, out: BinaryIO) -> None:
    """torch.save of `obj` into `out`, without the zip CRC32 of every record.

    torch.save computes that CRC32 single-threaded and it costs more than the write itself;
    the manifest's sha256 already covers every byte (torch.load reads such files). torch's
    switch for it is process-wide (`torch.serialization.set_crc32_options`): flipping it would
    change a torch.save that the user's own code runs meanwhile on another thread (a background
    save makes that likely). So this save gets its own zip writer with CRC32 off and the
    setting is never touched. A torch without those internals gets a plain torch.save."""
    import pickle

    import torch
    from torch import serialization

    make_writer = getattr(torch._C, "PyTorchFileWriter", None)
    save_records = getattr(serialization, "_save", None)
    alignment = getattr(serialization, "_get_storage_alignment", None)
    if make_writer is None or save_records is None or alignment is None:
        torch.save(obj, out)
        return
    zip_writer = make_writer(out, False, alignment())
    try:
        save_records(obj, zip_writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # the archive must be ended even when the save failed (torch.save does it in its
        # context's exit): a writer destroyed open aborts the process
        with contextlib.suppress(Exception):
            zip_writer.write_end_of_file()
        raise
    zip_writer.write_end_of_file()
    out.flush()
