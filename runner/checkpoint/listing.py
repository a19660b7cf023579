"""Find the checkpoints at a location and read their manifests.

A manifest is read with a bound (at most MAX_MANIFEST_BYTES leave the storage) and checked
against the step its directory is named after; a local one is opened without following a
symlink (`open_local`, also used by `verify` and `load` for the files it lists).
"""

from __future__ import annotations

import io
from pathlib import Path

from runner.checkpoint.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    checkpoint_key,
    manifest_key,
    parse_step_dir,
)
from runner.checkpoint.manifest import MAX_MANIFEST_BYTES, Manifest
from runner.errors import IntegrityError, StorageNotFoundError
from runner.storage.base import Storage
from runner.storage.file import FileStorage


def list_checkpoints(storage: Storage) -> list[int]:
    """Steps that have a manifest, ascending numeric."""
    steps = set()
    for info in storage.list(f"{CHECKPOINTS_DIR}/"):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST_NAME:
            step = parse_step_dir(parts[1])
            if step is not None:
                steps.add(step)
    return sorted(steps)


def local_step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / checkpoint_key(step)


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The manifest of checkpoint `step` at `storage`, read with a bound (at most
    MAX_MANIFEST_BYTES + 1 bytes ever leave the storage) and checked against the step its
    directory is named after."""
    key = manifest_key(step)
    source = f"{storage.uri}/{key}"
    try:
        raw = read_manifest_bytes(storage, key)
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{source}: manifest is missing") from exc
    manifest = Manifest.from_json(raw, source=source)
    check_named_step(manifest, step, source=source)
    return manifest


def read_manifest_bytes(storage: Storage, key: str) -> bytes:
    """A manifest's raw bytes, bounded: its size is asked first and one larger than
    MAX_MANIFEST_BYTES is refused unread; then one whole-object read, which the backend
    retries like any other request (a streamed read cut mid-way would not be).
    StorageNotFoundError when absent."""
    source = f"{storage.uri}/{key}"
    if storage.head(key).size > MAX_MANIFEST_BYTES:
        raise IntegrityError(
            f"{source}: larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have; not "
            "read, refusing it"
        )
    raw = storage.get_bytes(key)
    check_manifest_size(raw, source=source)  # it grew between the two requests
    return raw


def read_manifest_dir(step_dir: Path) -> Manifest:
    """The manifest of a local checkpoint directory: not a symlink, at most
    MAX_MANIFEST_BYTES read, and its step the one the directory is named after (a directory
    not named step_N, such as a staging one, is not compared)."""
    step_dir = Path(step_dir)
    source = str(step_dir / MANIFEST_NAME)
    storage, name = dir_storage(step_dir)
    try:
        with storage.open_read(f"{name}/{MANIFEST_NAME}") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{source}: manifest is missing") from exc
    check_manifest_size(raw, source=source)
    manifest = Manifest.from_json(raw, source=source)
    check_named_step(manifest, parse_step_dir(step_dir.name), source=source)
    return manifest


def check_manifest_size(raw: bytes, *, source: str) -> None:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise IntegrityError(
            f"{source}: larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have; not "
            "read further, refusing it"
        )


def check_named_step(manifest: Manifest, step: int | None, *, source: str) -> None:
    if step is not None and manifest.step != step:
        raise IntegrityError(
            f"{source}: manifest says step {manifest.step}, its directory is named step {step}; "
            "the checkpoint is mislabelled or forged"
        )


def dir_storage(step_dir: Path) -> tuple[FileStorage, str]:
    """The no-symlink reader for files of `step_dir`: a FileStorage rooted at its parent, so
    the step directory itself and everything below it are opened with O_NOFOLLOW."""
    step_dir = Path(step_dir).absolute()
    return FileStorage(step_dir.parent), step_dir.name


def open_local(step_dir: Path, rel: str) -> io.BufferedReader:
    storage, name = dir_storage(step_dir)
    try:
        return storage.open_read(f"{name}/{rel}")  # type: ignore[return-value]
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{step_dir / rel}: listed in the manifest but missing") from exc
