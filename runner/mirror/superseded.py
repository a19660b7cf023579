"""The order in which a re-based run replaces an older lineage's checkpoints in a mirror.

A resume at more ranks rescales the step down: the state resumed from (step R, S samples) is
committed again at the re-based step B < R, and the mirror's checkpoints numbered from B up
holding no more than S samples are an older lineage whose numbers say newer. Both re-base
paths (runner/session/rebase.py in process, runner/supervisor/rebased.py under `runner run`)
replace them in this order, so that a stop or a crash at any point leaves the mirror
resumable from its newest state and deletes nothing (de-committed = manifest kept aside):

1. before the re-based checkpoint is uploaded (`before_landing`): de-commit the older
   lineage numbered from B up, all but its newest (most samples): that one holds the state
   until the re-based checkpoint is in; the others are older than it, and the one at B
   itself would refuse the upload;
2. upload the re-based checkpoint;
3. once it (or any checkpoint holding at least S samples) is in (`after_landing`):
   de-commit the rest of the older lineage numbered above B; only now may newer checkpoints
   of the new lineage follow (one of them may be numbered like a stale step).

Between 2 and 3 the mirror holds the re-based checkpoint beside one stale checkpoint of the
same state (a step-ordered resume picks the stale one and re-bases again: nothing is lost).
A run may end 75 only after 3.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from runner.checkpoint.aside import decommit_remote
from runner.checkpoint.layout import manifest_key
from runner.checkpoint.listing import list_checkpoints, read_manifest_bytes
from runner.checkpoint.manifest import Manifest
from runner.errors import IntegrityError, StorageNotFoundError
from runner.mirror.remote_layout import same_checkpoint
from runner.storage.base import Storage

log = logging.getLogger(__name__)

SUPERSEDED = "superseded-by-rescale"


@dataclass(frozen=True)
class Held:
    """A committed checkpoint of the mirror and the manifest bytes it was judged by."""

    step: int
    manifest: Manifest
    raw: bytes


def older_lineage(storage: Storage, *, step: int, samples: int) -> list[Held]:
    """The mirror's checkpoints numbered from `step` up holding 0 < samples_seen <= `samples`
    (older states than a re-based one at `step` with `samples`), lowest step first. A step
    whose manifest cannot be read is left out (nothing is judged on a guess)."""
    held = []
    for candidate in list_checkpoints(storage):
        if candidate < step:
            continue
        found = read_held(storage, candidate)
        if found is not None and 0 < found.manifest.samples_seen <= samples:
            held.append(found)
    return held


def before_landing(
    storage: Storage, *, step: int, samples: int, rebased: Manifest | None = None
) -> list[int]:
    """Step 1: de-commit the older lineage numbered from `step` up, except its newest (most
    samples, then highest step) and `rebased` when it is already there. Returns the steps
    de-committed; raises RunnerError when the store fails (the rest stays committed)."""
    stale = [
        h
        for h in older_lineage(storage, step=step, samples=samples)
        if rebased is None or not same_checkpoint(h.manifest, rebased)
    ]
    if not stale:
        return []
    newest = max(stale, key=lambda h: (h.manifest.samples_seen, h.step))
    gone = []
    for h in stale:
        if h is newest:
            continue
        log.warning(
            "mirror: de-committing step %d (%d samples) to make room for the re-based step "
            "%d (%d samples); step %d (%d samples) holds the state until it is there",
            h.step,
            h.manifest.samples_seen,
            step,
            samples,
            newest.step,
            newest.manifest.samples_seen,
        )
        decommit_remote(storage, h.step, reason=SUPERSEDED, expected=h.raw)
        gone.append(h.step)
    return gone


def after_landing(storage: Storage, *, step: int, samples: int) -> list[int]:
    """Step 3, once a checkpoint holding at least `samples` is in the mirror: de-commit every
    checkpoint numbered above `step` holding no more than `samples` (never one with more).
    Returns the steps de-committed; raises RunnerError when the store fails."""
    gone = []
    for h in older_lineage(storage, step=step + 1, samples=samples):
        log.warning(
            "mirror: de-committing step %d (%d samples): older than the re-based step %d "
            "(%d samples) now in %s",
            h.step,
            h.manifest.samples_seen,
            step,
            samples,
            storage.uri,
        )
        decommit_remote(storage, h.step, reason=SUPERSEDED, expected=h.raw)
        gone.append(h.step)
    return gone


def read_held(storage: Storage, step: int) -> Held | None:
    """The mirror's manifest of `step` with its bytes; None when it has none or one this
    runner cannot read. A store that fails raises StorageError: a stale step it hid would
    stay committed."""
    key = manifest_key(step)
    try:
        raw = read_manifest_bytes(storage, key)
        return Held(step, Manifest.from_json(raw, source=f"{storage.uri}/{key}"), raw)
    except StorageNotFoundError:
        return None
    except (IntegrityError, ValueError):
        return None
