"""Debris in a location: objects under `checkpoints/` that no manifest names.

A mirror gathers two kinds, both invisible to readers (they follow manifests) but billed:
the payload of an upload whose node died before its manifest went up, and the attempt
directory of the loser of a manifest race (see runner.mirror.remote_layout). Only objects
older than a minimum age are candidates, and a step at or above the newest committed one is
never touched: another pod may be uploading it right now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

from runner.checkpoint.aside import protected_keys
from runner.checkpoint.layout import CHECKPOINTS_DIR, checkpoint_key, manifest_key, parse_step_dir
from runner.checkpoint.listing import read_manifest
from runner.errors import RunnerError
from runner.storage.base import ObjectInfo, Storage

log = logging.getLogger(__name__)

# An upload of one checkpoint lasts minutes; a day leaves a wide margin for a slow link.
ORPHAN_MIN_AGE_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Sweep:
    deleted: list[ObjectInfo]

    @property
    def bytes(self) -> int:
        return sum(info.size for info in self.deleted)


def find_orphans(
    storage: Storage,
    *,
    older_than_s: float,
    protect: Collection[int] = (),
    now: float | None = None,
) -> list[ObjectInfo]:
    """Objects under `checkpoints/step_N/` that step N's manifest does not name (every object
    of a step without a manifest below the newest committed step), last modified at least
    `older_than_s` ago. Steps in `protect` and steps whose manifest cannot be read are left
    alone: what cannot be interpreted is not deleted."""
    by_step: dict[int, list[ObjectInfo]] = {}
    for info in storage.list(f"{CHECKPOINTS_DIR}/"):
        parts = info.key.split("/")
        step = parse_step_dir(parts[1]) if len(parts) >= 3 else None
        if step is not None:
            by_step.setdefault(step, []).append(info)
    committed = {
        step for step, infos in by_step.items() if any(i.key == manifest_key(step) for i in infos)
    }
    newest = max(committed, default=None)
    kept = protected_keys(storage)  # the payload of a checkpoint set aside as foreign
    cutoff = (time.time() if now is None else now) - older_than_s
    orphans: list[ObjectInfo] = []
    for step, infos in sorted(by_step.items()):
        if step in protect:
            continue
        if step in committed:
            try:
                manifest = read_manifest(storage, step)
            except RunnerError as exc:
                log.warning("orphan sweep: leaving step %d alone: %s", step, exc)
                continue
            base = checkpoint_key(step)
            named = {f"{base}/{entry.path}" for entry in manifest.files} | {manifest_key(step)}
        elif newest is not None and step < newest:
            named = set()
        else:  # the newest step or beyond: possibly an upload in flight
            continue
        orphans += [
            info
            for info in infos
            if info.key not in named
            and info.key not in kept
            and info.modified is not None
            and info.modified <= cutoff
        ]
    return orphans


def sweep_orphans(storage: Storage, *, older_than_s: float, protect: Collection[int] = ()) -> Sweep:
    """Delete what `find_orphans` finds; returns what was deleted."""
    sweep = Sweep(find_orphans(storage, older_than_s=older_than_s, protect=protect))
    for info in sweep.deleted:
        storage.delete(info.key)
    if sweep.deleted:
        log.info(
            "deleted %d orphan objects (%d bytes) that no manifest names from %s",
            len(sweep.deleted),
            sweep.bytes,
            storage.uri,
        )
    return sweep
