"""Keep the newest K checkpoints; never delete the newest one that verifies.

K >= 2 because the newest may still be in flight (being mirrored, or not yet verified). Deleting
removes the manifest first, so a checkpoint stops existing before any of its files go: a crash
half-way leaves debris readers ignore, never a manifest naming missing files.
"""

from __future__ import annotations

import logging

from runner.checkpoint.layout import checkpoint_key, manifest_key
from runner.checkpoint.reader import list_checkpoints, newest_verified
from runner.errors import ConfigError
from runner.storage.base import Storage

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
    """Manifest first (the checkpoint ceases to exist), then every other object under it."""
    storage.delete(manifest_key(step))
    for info in list(storage.list(f"{checkpoint_key(step)}/")):
        storage.delete(info.key)
