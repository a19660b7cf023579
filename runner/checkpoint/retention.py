"""Keep the newest K usable checkpoints; never delete one that might be the last good one.

K >= 2 because the newest may still be in flight (being mirrored, or not yet verified). Deleting
removes the manifest first, so a checkpoint stops existing before any of its files go: a crash
half-way leaves debris readers ignore, never a manifest naming missing files.
"""

from __future__ import annotations

import logging
import os
import shutil

from runner.atomicity.files import fsync_dir
from runner.atomicity.temp import temp_path
from runner.checkpoint.aside import ProtectedKeys, protected_keys
from runner.checkpoint.counter_check import check_payload_counters
from runner.checkpoint.layout import checkpoint_key, manifest_key
from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.newest import newest_first, read_manifests
from runner.checkpoint.verify import check_remote_sizes, verify_checkpoint, verify_dir
from runner.errors import (
    ConfigError,
    RunnerError,
    SchemaError,
)
from runner.storage.base import Storage

log = logging.getLogger(__name__)

MIN_KEEP = 2


def prune(
    storage: Storage,
    *,
    keep: int,
    protect: set[int] | frozenset[int] = frozenset(),
    newest_ok: int | None = None,
    known_good: set[int] | None = None,
    remote_sizes_only: bool = False,
    aside: ProtectedKeys | None = None,
) -> list[int]:
    """Keep the newest `keep` checkpoints that are usable (newest by progress,
    runner.checkpoint.newest); delete older ones. Returns the deleted steps.

    A checkpoint that fails its check is never counted among the K kept, and one newer than
    the K-th kept is left alone (a heal may still replace it). One of a schema this runner
    cannot read is never deleted at all (it may be good for another version), nor is any step
    in `protect`. How "usable" is checked: steps in `known_good` (and `newest_ok`) are taken
    as good, e.g. what this process committed or uploaded itself; every other candidate is
    verified (sizes, sha256, counters; a remote one streamed), except that with
    `remote_sizes_only` a mirror's candidate is checked by manifest and sizes only (the
    background mirror: hashing a remote copy means downloading it, and what it trusts most it
    uploaded itself). Steps found good are added to `known_good`, so a caller that keeps the
    set checks each checkpoint once. Objects that aside records protect are never deleted
    (`aside`: `protected_keys(storage)` when the caller read it already, else read here, once,
    before the first deletion). Long: one newest-first pass that counts the K usable ones,
    skips protected and foreign ones and deletes the rest, read top to bottom."""
    if keep < MIN_KEEP:
        raise ConfigError(
            f"--keep must be >= {MIN_KEEP} (got {keep}): the newest checkpoint may still be in "
            "flight, and the newest verified one must survive"
        )
    good = known_good if known_good is not None else set()
    if newest_ok is not None:
        good.add(newest_ok)
    steps = list_checkpoints(storage)
    if len(steps) <= keep:
        return []
    counted = 0
    deleted = []
    protected = aside  # read once, at the first deletion
    for step in newest_first(read_manifests(storage, steps)):
        if counted < keep:
            if step in good or usable(storage, step, sizes_only=remote_sizes_only):
                good.add(step)
                counted += 1
            continue
        if step in protect or foreign(storage, step):
            continue
        if protected is None:
            protected = protected_keys(storage)
        delete_checkpoint(storage, step, protected=protected)
        good.discard(step)
        deleted.append(step)
    if deleted:
        log.info("pruned checkpoints %s from %s", deleted, storage.uri)
    return deleted


def usable(storage: Storage, step: int, *, sizes_only: bool) -> bool:
    """Whether the step verifies (sizes only for a remote one when `sizes_only`); a warning
    names one that does not."""
    try:
        step_dir = storage.local_path(checkpoint_key(step))
        if step_dir is not None:
            verify_dir(step_dir)
        elif sizes_only:
            check_remote_sizes(storage, step)
        else:
            verify_checkpoint(storage, step)
    except RunnerError as exc:
        log.warning(
            "retention: checkpoint step %d at %s is not counted as kept: %s",
            step,
            storage.uri,
            exc,
        )
        return False
    return True


def foreign(storage: Storage, step: int) -> bool:
    """True when the step's manifest is of a schema this runner cannot read or, in a run dir,
    its payload is one this runner cannot load (read mapped: no hashing, no full read)."""
    try:
        manifest = read_manifest(storage, step)
        step_dir = storage.local_path(checkpoint_key(step))
        if step_dir is not None:
            check_payload_counters(step_dir, manifest)
    except SchemaError as exc:
        log.warning("retention: leaving step %d at %s alone: %s", step, storage.uri, exc)
        return True
    except RunnerError:
        return False
    return False


def delete_checkpoint(
    storage: Storage, step: int, *, protected: ProtectedKeys | None = None
) -> None:
    """Manifest first (the checkpoint ceases to exist), then every other object under it
    except those an aside record protects (`protected`: `protected_keys(storage)`, read here
    when not given; what it spares is added to its `kept`).

    In a local directory with nothing protected under the step, the whole step dir is first
    renamed to a `.tmp-` name, so it vanishes at once and a crash leaves only a temp dir that
    `cleanup_partial` removes."""
    base = checkpoint_key(step)
    if protected is None:
        protected = protected_keys(storage)
    step_dir = storage.local_path(base)
    if step_dir is not None and not protected.under(step):
        aside = temp_path(step_dir, tag="pruned")
        try:
            os.rename(step_dir, aside)
        except FileNotFoundError:
            return
        fsync_dir(step_dir.parent)
        shutil.rmtree(aside, ignore_errors=True)
        return
    storage.delete(manifest_key(step))
    spared = 0
    for info in list(storage.list(f"{base}/")):
        if info.key in protected:
            protected.spare(info)
            spared += 1
        else:
            storage.delete(info.key)
    if spared:
        log.info(
            "retention: deleted checkpoint step %d but kept %d object(s) under %s/%s that "
            "aside records name (set aside, never deleted)",
            step,
            spared,
            storage.uri,
            base,
        )
