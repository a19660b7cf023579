"""Keep the newest K checkpoints; never delete the newest one that verifies.

K >= 2 because the newest may still be in flight (being mirrored, or not yet verified). Deleting
removes the manifest first, so a checkpoint stops existing before any of its files go: a crash
half-way leaves debris readers ignore, never a manifest naming missing files.
"""

from __future__ import annotations

import logging
import os
import shutil
from uuid import uuid4

from runner.checkpoint.atomic import fsync_dir
from runner.checkpoint.layout import TMP_PREFIX, checkpoint_key, manifest_key
from runner.checkpoint.reader import list_checkpoints, newest_verified
from runner.errors import ConfigError
from runner.storage.base import Storage
from runner.storage.file import FileStorage

log = logging.getLogger(__name__)

MIN_KEEP = 2


def prune(
    storage: Storage,
    *,
    keep: int,
    protect: set[int] | frozenset[int] = frozenset(),
    newest_ok: int | None = None,
) -> list[int]:
    """Delete all but the newest `keep` checkpoints, sparing `protect` and the newest one that
    verifies (pass `newest_ok` when the caller already knows it, to skip re-hashing).
    Returns the deleted steps."""
    if keep < MIN_KEEP:
        raise ConfigError(
            f"--keep must be >= {MIN_KEEP} (got {keep}): the newest checkpoint may still be in "
            "flight, and the newest verified one must survive"
        )
    steps = list_checkpoints(storage)
    candidates = steps[:-keep]
    if not candidates:
        return []
    if newest_ok is None:
        manifest = newest_verified(storage)
        newest_ok = manifest.step if manifest is not None else None
    spared = set(protect) | ({newest_ok} if newest_ok is not None else set())
    deleted = []
    for step in candidates:
        if step in spared:
            continue
        delete_checkpoint(storage, step)
        deleted.append(step)
    if deleted:
        log.info("pruned checkpoints %s from %s", deleted, storage.uri)
    return deleted


def delete_checkpoint(storage: Storage, step: int) -> None:
    """Manifest first (the checkpoint ceases to exist), then every other object under it.

    In a local directory the whole step dir is first renamed to a `.tmp-` name, so it vanishes
    at once and a crash leaves only a temp dir that `cleanup_partial` removes."""
    if isinstance(storage, FileStorage):
        step_dir = storage.root / checkpoint_key(step)
        aside = step_dir.with_name(
            f"{TMP_PREFIX}{step_dir.name}-{os.getpid()}-pruned-{uuid4().hex[:8]}"
        )
        try:
            os.rename(step_dir, aside)
        except FileNotFoundError:
            return
        fsync_dir(step_dir.parent)
        shutil.rmtree(aside, ignore_errors=True)
        return
    storage.delete(manifest_key(step))
    for info in list(storage.list(f"{checkpoint_key(step)}/")):
        storage.delete(info.key)
