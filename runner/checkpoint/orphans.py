"""Debris in a location: objects under `checkpoints/` that no manifest names.

A mirror gathers two kinds, both invisible to readers (they follow manifests) but billed:
the payload of an upload whose node died before its manifest went up, and the attempt
directory of the loser of a manifest race (see runner.mirror.remote_layout). Only objects
older than a minimum age are candidates, and a step at or above the newest committed one is
never touched: another pod may be uploading it right now. Nor is the payload of a checkpoint
set aside (runner.checkpoint.aside): no manifest names it any more, its aside record does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

from runner.checkpoint.aside import ProtectedKeys, protected_keys
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
    aside: ProtectedKeys | None = None,
) -> list[ObjectInfo]:
    """Objects under `checkpoints/step_N/` that step N's manifest does not name (every object
    of a step without a manifest below the newest committed step), last modified at least
    `older_than_s` ago. Steps in `protect` and steps whose manifest cannot be read are left
    alone: what cannot be interpreted is not deleted. Nor is an object an aside record
    protects (`aside`: `protected_keys(storage)`, read here when not given); those it would
    otherwise have taken are added to its `kept`."""
    by_step = _objects_by_step(storage)
    committed = {
        step for step, infos in by_step.items() if any(i.key == manifest_key(step) for i in infos)
    }
    newest = max(committed, default=None)
    kept = aside if aside is not None else protected_keys(storage)
    cutoff = (time.time() if now is None else now) - older_than_s
    orphans: list[ObjectInfo] = []
    spared: list[str] = []
    for step, infos in sorted(by_step.items()):
        if step in protect:
            continue
        named = _named_keys(storage, step, committed=committed, newest=newest)
        if named is None:
            continue
        for info in _stale_unnamed(infos, named, cutoff):
            if info.key in kept:
                kept.spare(info)
                spared.append(info.key)
            else:
                orphans.append(info)
    if spared:
        _log_spared(storage, spared)
    return orphans


def _objects_by_step(storage: Storage) -> dict[int, list[ObjectInfo]]:
    """The objects under `checkpoints/step_N/`, by N; anything else there is not a step's."""
    by_step: dict[int, list[ObjectInfo]] = {}
    for info in storage.list(f"{CHECKPOINTS_DIR}/"):
        parts = info.key.split("/")
        step = parse_step_dir(parts[1]) if len(parts) >= 3 else None
        if step is not None:
            by_step.setdefault(step, []).append(info)
    return by_step


def _named_keys(
    storage: Storage, step: int, *, committed: Collection[int], newest: int | None
) -> set[str] | None:
    """The keys of step `step` that are not debris: what its manifest names (and the manifest
    itself); nothing for an uncommitted step below the newest committed one. None when the
    step must be left alone: its manifest cannot be read (what cannot be interpreted is not
    deleted), or it is the newest step or beyond (possibly an upload in flight)."""
    if step in committed:
        try:
            manifest = read_manifest(storage, step)
        except RunnerError as exc:
            log.warning("orphan sweep: leaving step %d alone: %s", step, exc)
            return None
        base = checkpoint_key(step)
        return {f"{base}/{entry.path}" for entry in manifest.files} | {manifest_key(step)}
    if newest is not None and step < newest:
        return set()
    return None


def _stale_unnamed(
    infos: list[ObjectInfo], named: Collection[str], cutoff: float
) -> list[ObjectInfo]:
    """The objects `named` leaves out, last modified at or before `cutoff`; one without a
    modification time is never old enough (its age is unknown)."""
    return [
        info
        for info in infos
        if not (info.key in named or info.modified is None or info.modified > cutoff)
    ]


def _log_spared(storage: Storage, spared: list[str]) -> None:
    """Say what the aside records kept from the sweep (the first five keys: there may be many)."""
    log.info(
        "orphan sweep: keeping %d object(s) in %s that no manifest names but aside records "
        "do (set aside, never deleted): %s",
        len(spared),
        storage.uri,
        ", ".join(spared[:5]) + (", ..." if len(spared) > 5 else ""),
    )


def sweep_orphans(
    storage: Storage,
    *,
    older_than_s: float,
    protect: Collection[int] = (),
    aside: ProtectedKeys | None = None,
) -> Sweep:
    """Delete what `find_orphans` finds; returns what was deleted."""
    sweep = Sweep(find_orphans(storage, older_than_s=older_than_s, protect=protect, aside=aside))
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
