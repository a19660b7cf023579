"""Verify checkpoints: one rule set, two ways to apply it.

Verifying goes through the `Storage` protocol, so it works the same on a run dir, `file://`
and `s3://`: a local directory is hashed in place on several threads, any other storage is
streamed. Every command (`verify`, `status`, `ls --verify`, `pull`, `push`, resume) uses it:
a checkpoint verifies when

1. its manifest is at most MAX_MANIFEST_BYTES (no more is read), parses, and stays within the
   bounds `Manifest.validate` sets (files, path lengths, plausible step and sizes);
2. the manifest's step is the step its directory is named after;
3. every listed file is a canonical relative path, present, a regular file and not a symlink
   (nor under a symlinked directory inside the checkpoint), of the listed size and sha256;
4. the counters inside the payload agree with the manifest (runner.checkpoint.counter_check,
   which says how far a remote payload is read for them).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from runner.atomicity.files import hash_range, hash_stream
from runner.checkpoint.chunk_digests import Chunk
from runner.checkpoint.counter_check import check_payload_counters, check_remote_counters
from runner.checkpoint.formats.dcp import rank_of_file
from runner.checkpoint.layout import MANIFEST_NAME, checkpoint_key, parse_step_dir
from runner.checkpoint.listing import (
    check_named_step,
    open_local,
    read_manifest,
    read_manifest_dir,
)
from runner.checkpoint.manifest import FORMAT_DCP, FileEntry, Manifest, check_relative_path
from runner.checkpoint.newest import steps_newest_first
from runner.errors import IntegrityError, RunnerError, StorageNotFoundError
from runner.storage.base import Storage

log = logging.getLogger(__name__)

SkipCallback = Callable[[int, str], None]
T = TypeVar("T")
SkipTypes = type[Exception] | tuple[type[Exception], ...]


@dataclass
class CheckpointStatus:
    step: int
    ok: bool
    error: str | None
    manifest: Manifest | None


def _where(base: str, entry: FileEntry, manifest: Manifest) -> str:
    """A listed file's location in a message; in a multi-rank checkpoint, also the rank that
    wrote it (the one whose disk or save to suspect)."""
    where = f"{base}/{entry.path}"
    if manifest.format == FORMAT_DCP:
        rank = rank_of_file(entry.path)
        if rank is not None:
            return f"{where} (written by rank {rank})"
    return where


def check_remote_sizes(storage: Storage, step: int) -> Manifest:
    """The cheap check of a stored checkpoint: its manifest (bounded, named step) and every
    file it lists present at the listed size; IntegrityError otherwise. No byte is hashed."""
    manifest = read_manifest(storage, step)
    base = checkpoint_key(step)
    for entry in manifest.files:
        where = _where(f"{storage.uri}/{base}", entry, manifest)
        try:
            size = storage.head(f"{base}/{entry.path}").size
        except StorageNotFoundError as exc:
            raise IntegrityError(f"{where}: listed in the manifest but missing") from exc
        if size != entry.size:
            raise IntegrityError(
                f"{where}: size {size} != {entry.size} in the manifest (truncated or replaced)"
            )
    return manifest


def verify_checkpoint(storage: Storage, step: int) -> Manifest:
    """Apply every rule of the module docstring to checkpoint `step` at `storage`.

    A local location (a run dir, `file://`) is checked in place by `verify_dir` (hashed on
    several threads, symlinks refused); any other storage is streamed."""
    step_dir = storage.local_path(checkpoint_key(step))
    if step_dir is not None:
        # FileStorage refuses a symlinked checkpoints/ dir when listing; here the step dir
        # and everything in it are checked without following any symlink
        return verify_dir(step_dir, step=step)
    manifest = check_remote_sizes(storage, step)
    base = checkpoint_key(step)
    for entry in manifest.files:
        where = _where(f"{storage.uri}/{base}", entry, manifest)
        try:
            with storage.open_read(f"{base}/{entry.path}") as stream:
                _, sha256 = hash_stream(stream)
        except StorageNotFoundError as exc:
            raise IntegrityError(f"{where}: listed in the manifest but missing") from exc
        if sha256 != entry.sha256:
            raise IntegrityError(f"{where}: sha256 mismatch (the file is corrupt)")
    check_remote_counters(storage, base, manifest)
    return manifest


@dataclass(frozen=True)
class Verdict(Generic[T]):
    """One checkpoint of a newest-first walk: what its check returned, or why it failed."""

    step: int
    value: T | None = None
    """What the check returned (the verified manifest for `iter_verified`); None on failure."""
    exc: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.exc is None

    @property
    def error(self) -> str | None:
        return None if self.exc is None else str(self.exc)


def iter_checked(
    storage: Storage,
    check: Callable[[Storage, int], T],
    *,
    steps: Iterable[int] | None = None,
    skip: SkipTypes = RunnerError,
    on_skip: SkipCallback | None = None,
) -> Iterator[Verdict[T]]:
    """The one walk behind every "newest checkpoint that verifies": `check(storage, step)` on
    each committed checkpoint, newest first by progress (runner.checkpoint.newest), one
    Verdict each.

    Lazy: a checkpoint is checked only when its verdict is asked for, so a caller that stops
    at the first good one hashes nothing older. A failure of a `skip` type is yielded (and
    reported to `on_skip(step, why)` first) and the walk goes on; any other error propagates.
    `steps`: walk these, in this order, instead (e.g. the one step a user named)."""
    for step in steps_newest_first(storage) if steps is None else steps:
        try:
            value = check(storage, step)
        except skip as exc:
            if on_skip is not None:
                on_skip(step, str(exc))
            yield Verdict(step=step, exc=exc)
        else:
            yield Verdict(step=step, value=value)


def iter_verified(
    storage: Storage,
    *,
    hashing: bool = True,
    steps: Iterable[int] | None = None,
    on_skip: SkipCallback | None = None,
) -> Iterator[Verdict[Manifest]]:
    """`iter_checked` with the rules of the module docstring (`verify_checkpoint`), or with
    `hashing=False` only the manifest's (`read_manifest`: bounded, parses, its named step);
    every RunnerError is a failed verdict."""
    check = verify_checkpoint if hashing else read_manifest
    return iter_checked(storage, check, steps=steps, on_skip=on_skip)


def scan(storage: Storage) -> list[CheckpointStatus]:
    """Verify every checkpoint, newest first; a failure is recorded, not raised."""
    return [
        CheckpointStatus(step=v.step, ok=v.ok, error=v.error, manifest=v.value)
        for v in iter_verified(storage)
    ]


def newest_verified(storage: Storage, *, on_skip: SkipCallback | None = None) -> Manifest | None:
    """The newest checkpoint whose files all verify; each newer one skipped is logged and
    reported to `on_skip(step, why)`."""

    def skipped(step: int, why: str) -> None:
        log.warning("skipping checkpoint step %d at %s: %s", step, storage.uri, why)
        if on_skip is not None:
            on_skip(step, why)

    return next((v.value for v in iter_verified(storage, on_skip=skipped) if v.ok), None)


def verify_dir(
    step_dir: Path,
    *,
    manifest: Manifest | None = None,
    step: int | None = None,
    counters: bool = True,
) -> Manifest:
    """Apply every rule of the module docstring to a local checkpoint directory (sizes first,
    a cheap check before hashing; the counters last). `step`: the step the caller expects
    (default: the one in the directory's name). `counters=False` is for `load_state`, which
    checks the counters of what it deserialised instead of reading them twice."""
    step_dir = Path(step_dir)
    if manifest is None:
        manifest = read_manifest_dir(step_dir)
    else:
        check_named_step(
            manifest, parse_step_dir(step_dir.name), source=str(step_dir / MANIFEST_NAME)
        )
    check_named_step(manifest, step, source=str(step_dir / MANIFEST_NAME))
    checked = check_sizes(step_dir, manifest)
    chunks = manifest.chunks(source=str(step_dir / MANIFEST_NAME))
    # one sha256 cannot be split across cores, but several files, and the chunks of a file
    # listed with chunk digests (runner.checkpoint.chunk_digests), can be hashed at once
    whole: list[Chunk | None] = [None]
    checks = [(entry, chunk) for _, entry in checked for chunk in chunks.get(entry.path, whole)]
    workers = max(1, min(len(checks), os.cpu_count() or 1, 8))

    def digest(entry: FileEntry, chunk: Chunk | None) -> str:
        with open_local(step_dir, entry.path) as f:
            if chunk is None:
                size, sha256 = hash_stream(f)
            else:
                read, sha256 = hash_range(f, chunk.offset, chunk.size)
                size = chunk.offset + read if read < chunk.size else entry.size
        if size != entry.size:
            raise IntegrityError(
                f"{_where(str(step_dir), entry, manifest)}: size {size} != {entry.size} in the "
                "manifest (changed while it was being verified)"
            )
        return sha256

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify")
    try:
        digests = pool.map(lambda check: digest(*check), checks)
        for (entry, chunk), sha256 in zip(checks, digests, strict=True):
            if sha256 != (entry.sha256 if chunk is None else chunk.sha256):
                raise IntegrityError(
                    f"{_where(str(step_dir), entry, manifest)}: sha256 mismatch"
                    f"{_in_chunk(chunk)} (the file is corrupt)"
                )
    finally:
        # a refusal does not wait for the rest of a large checkpoint to be hashed
        pool.shutdown(wait=True, cancel_futures=True)
    if counters:
        check_payload_counters(step_dir, manifest)
    return manifest


def _in_chunk(chunk: Chunk | None) -> str:
    if chunk is None:
        return ""
    return f" in chunk {chunk.index} (bytes {chunk.offset}-{chunk.offset + chunk.size - 1})"


def check_sizes(step_dir: Path, manifest: Manifest) -> list[tuple[Path, FileEntry]]:
    """Every listed file present, a regular file inside the directory, neither it nor a
    directory on its way (the step directory included) a symlink, and of the listed size (no
    hashing); returns each path with its entry."""
    step_dir = Path(step_dir)
    root = step_dir.resolve()
    _refuse_symlink(step_dir, step_dir)
    paths = []
    for entry in manifest.files:
        rel = check_relative_path(entry.path, source=str(step_dir / MANIFEST_NAME))
        path = step_dir / rel
        where = _where(str(step_dir), entry, manifest)
        current = step_dir
        st: os.stat_result | None = None
        for part in rel.split("/"):
            current = current / part
            try:
                st = current.lstat()
            except (FileNotFoundError, NotADirectoryError) as exc:
                raise IntegrityError(f"{where}: listed in the manifest but missing") from exc
            if stat.S_ISLNK(st.st_mode):
                _refuse_symlink(current, root)
        assert st is not None
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{where}: not a regular file; refusing to read it")
        if st.st_size != entry.size:
            raise IntegrityError(
                f"{where}: size {st.st_size} != {entry.size} in the manifest (truncated or "
                "replaced)"
            )
        paths.append((path, entry))
    return paths


def _refuse_symlink(path: Path, root: Path) -> None:
    """IntegrityError when `path` is a symlink (checkpoint writers never create one), saying
    whether it even resolves outside the checkpoint directory `root`."""
    if not path.is_symlink():
        return
    where = (
        "resolves outside the checkpoint directory"
        if not path.resolve().is_relative_to(root.resolve())
        else "points inside the checkpoint directory"
    )
    raise IntegrityError(f"{path}: is a symlink ({where}); refusing to follow it")
