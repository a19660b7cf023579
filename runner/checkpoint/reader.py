"""Find, verify and load checkpoints.

Listing and verifying go through the `Storage` protocol, so they work the same on a run dir,
`file://` and `s3://`. Loading is local: sizes and sha256 of every file are checked before
anything is deserialised, and deserialising is `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.checkpoint.atomic import hash_stream, sha256_file
from runner.checkpoint.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    checkpoint_key,
    manifest_key,
    parse_step_dir,
)
from runner.checkpoint.manifest import (
    FORMAT_SEED_BIN,
    FORMAT_SHARDED,
    FORMAT_TORCH,
    FileEntry,
    Manifest,
    check_relative_path,
)
from runner.checkpoint.payload import migrate_payload
from runner.errors import IntegrityError, RunnerError, SchemaError, StorageNotFoundError
from runner.storage.base import Storage

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"

SkipCallback = Callable[[int, str], None]


@dataclass
class CheckpointStatus:
    step: int
    ok: bool
    error: str | None
    manifest: Manifest | None


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


def read_manifest(storage: Storage, step: int) -> Manifest:
    key = manifest_key(step)
    source = f"{storage.uri}/{key}"
    try:
        raw = storage.get_bytes(key)
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{source}: manifest is missing") from exc
    manifest = Manifest.from_json(raw, source=source)
    if manifest.step != step:
        raise IntegrityError(f"{source}: manifest says step {manifest.step}, directory {step}")
    return manifest


def verify_checkpoint(storage: Storage, step: int) -> Manifest:
    """Check every file the manifest lists: present, right size, right sha256."""
    manifest = read_manifest(storage, step)
    base = checkpoint_key(step)
    for entry in manifest.files:
        where = f"{storage.uri}/{base}/{entry.path}"
        try:
            size = storage.head(f"{base}/{entry.path}").size
        except StorageNotFoundError as exc:
            raise IntegrityError(f"{where}: listed in the manifest but missing") from exc
        if size != entry.size:
            raise IntegrityError(
                f"{where}: size {size} != {entry.size} in the manifest (truncated or replaced)"
            )
        with storage.open_read(f"{base}/{entry.path}") as stream:
            _, sha256 = hash_stream(stream)
        if sha256 != entry.sha256:
            raise IntegrityError(f"{where}: sha256 mismatch (the file is corrupt)")
    return manifest


def scan(storage: Storage) -> list[CheckpointStatus]:
    """Verify every checkpoint, newest first; a failure is recorded, not raised."""
    statuses = []
    for step in reversed(list_checkpoints(storage)):
        try:
            manifest = verify_checkpoint(storage, step)
        except RunnerError as exc:
            statuses.append(CheckpointStatus(step=step, ok=False, error=str(exc), manifest=None))
        else:
            statuses.append(CheckpointStatus(step=step, ok=True, error=None, manifest=manifest))
    return statuses


def newest_verified(storage: Storage, *, on_skip: SkipCallback | None = None) -> Manifest | None:
    """The newest checkpoint whose files all verify; each newer one skipped is logged and
    reported to `on_skip(step, why)`."""
    for step in reversed(list_checkpoints(storage)):
        try:
            return verify_checkpoint(storage, step)
        except RunnerError as exc:
            log.warning("skipping checkpoint step %d at %s: %s", step, storage.uri, exc)
            if on_skip is not None:
                on_skip(step, str(exc))
    return None


# -- local ----------------------------------------------------------------------------------


def read_manifest_dir(step_dir: Path) -> Manifest:
    source = str(step_dir / MANIFEST_NAME)
    try:
        raw = (step_dir / MANIFEST_NAME).read_bytes()
    except FileNotFoundError as exc:
        raise IntegrityError(f"{source}: manifest is missing") from exc
    return Manifest.from_json(raw, source=source)


def verify_dir(step_dir: Path, *, manifest: Manifest | None = None) -> Manifest:
    """Verify a local checkpoint directory (sizes first: a cheap check before hashing)."""
    manifest = manifest or read_manifest_dir(step_dir)
    paths = check_sizes(step_dir, manifest)
    # one sha256 cannot be split across cores, but several files (shards) can be hashed at once
    workers = max(1, min(len(paths), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
        digests = pool.map(lambda item: sha256_file(item[0])[1], paths)
        for (_, entry), digest in zip(paths, digests, strict=True):
            if digest != entry.sha256:
                raise IntegrityError(
                    f"{step_dir / entry.path}: sha256 mismatch (the file is corrupt)"
                )
    return manifest


def check_sizes(step_dir: Path, manifest: Manifest) -> list[tuple[Path, FileEntry]]:
    """Every listed file present, inside the directory and of the listed size (no hashing);
    returns each resolved path with its entry."""
    root = step_dir.resolve()
    paths = []
    for entry in manifest.files:
        rel = check_relative_path(entry.path, source=str(step_dir / MANIFEST_NAME))
        path = (step_dir / rel).resolve()
        if not path.is_relative_to(root):  # a symlink pointing out of the directory
            raise IntegrityError(f"{step_dir / rel}: resolves outside the checkpoint directory")
        try:
            size = path.stat().st_size
        except FileNotFoundError as exc:
            raise IntegrityError(f"{step_dir / rel}: listed in the manifest but missing") from exc
        if size != entry.size:
            raise IntegrityError(
                f"{step_dir / rel}: size {size} != {entry.size} in the manifest "
                "(truncated or replaced)"
            )
        paths.append((path, entry))
    return paths


def load_state(
    step_dir: Path,
    *,
    manifest: Manifest | None = None,
    mmap: bool = False,
    verified: bool = False,
) -> dict[str, Any]:
    """Verify a local checkpoint, then deserialise its train state (schema migrated to v2).

    `mmap=True` maps tensors from the file (just read and hashed, so in the page cache)
    instead of copying them: faster and no second copy in memory, but the checkpoint's disk
    space stays in use while those tensors live, even after it is pruned.
    `verified=True`: the caller hashed these files against `manifest` moments ago in this
    process (resolve_resume does); only sizes and paths are checked again."""
    import torch  # imported here so listing/verifying commands start fast

    step_dir = Path(step_dir)
    if verified and manifest is not None:
        check_sizes(step_dir, manifest)
    else:
        manifest = verify_dir(step_dir, manifest=manifest)
    listed = {f.path: (f.size, f.sha256) for f in manifest.files}
    source = str(step_dir)
    try:
        if manifest.format == FORMAT_TORCH:
            if STATE_FILE not in listed:
                raise IntegrityError(f"{source}: the manifest does not list {STATE_FILE}")
            raw = torch.load(
                step_dir / STATE_FILE, weights_only=True, map_location="cpu", mmap=mmap
            )
        elif manifest.format == FORMAT_SHARDED:
            from runner.checkpoint.sharded import read_sharded

            raw = read_sharded(step_dir, listed=listed, mmap=mmap)
        elif manifest.format == FORMAT_SEED_BIN:
            raise SchemaError(
                f"{source}: a seed-bin checkpoint holds flat arrays, not a train state; map it "
                "onto a model with runner.checkpoint.seedbin.seed_to_state"
            )
        else:
            raise SchemaError(f"{source}: unknown checkpoint format {manifest.format!r}")
    except pickle.UnpicklingError as exc:
        raise IntegrityError(
            f"{source}: payload holds objects that weights-only loading refuses ({exc}); "
            "it was not written by spot-runner and was not executed"
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise IntegrityError(f"{source}: payload cannot be deserialised ({exc})") from exc
    return migrate_payload(raw, source=source)


def load_newest_state(
    run_dir: Path, *, on_skip: SkipCallback | None = None
) -> tuple[Manifest, dict[str, Any]] | None:
    """The newest local checkpoint that verifies *and* loads, with its state; every newer one
    that fails (corrupt, unknown schema, unsafe payload) is logged and reported to `on_skip`.
    None when the run dir holds no usable checkpoint."""
    from runner.storage.file import FileStorage

    for step in reversed(list_checkpoints(FileStorage(Path(run_dir)))):
        step_dir = local_step_dir(run_dir, step)
        try:
            manifest = read_manifest_dir(step_dir)
            return manifest, load_state(step_dir, manifest=manifest)
        except RunnerError as exc:
            log.warning("skipping checkpoint %s: %s", step_dir, exc)
            if on_skip is not None:
                on_skip(step, str(exc))
    return None


def local_step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / checkpoint_key(step)
