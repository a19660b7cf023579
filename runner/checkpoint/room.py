"""Room for a save that found its disk full: delete the oldest checkpoint older than the newest
verified one.

Retention runs only after a commit, so a run dir that holds --keep checkpoints and no room for
one more would otherwise fail every later save. What may go is exactly what retention would
delete first once the save commits: the oldest usable checkpoint, never the newest verified
one, never one of a schema this runner cannot read, never one whose objects an aside record
protects (whatever sits in `aside/` is not listed at all), never a step the caller protects
(the mirror is uploading it). A checkpoint that fails verification is left for `repair`.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from runner.checkpoint.aside import protected_keys
from runner.checkpoint.layout import checkpoint_key
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.retention import delete_checkpoint, foreign, usable
from runner.storage.file import FileStorage

__all__ = ["Room", "make_room", "out_of_space"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, kw_only=True)
class Room:
    """What was deleted to make room."""

    deleted: int
    freed_bytes: int
    """Disk space its files took (allocated blocks), now free."""
    newest_verified: int


def out_of_space(exc: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT OSError behind `exc` (itself or a cause), else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def make_room(
    storage: FileStorage,
    *,
    protect: set[int] | frozenset[int] = frozenset(),
    known_good: set[int] | None = None,
) -> Room | None:
    """Delete the oldest usable checkpoint older than the newest verified one; None when
    there is none (nothing is deleted then). `known_good`: steps taken as good without
    hashing (what this process committed or resumed from); the deleted step leaves it."""
    good = known_good if known_good is not None else set()
    steps = list_checkpoints(storage)
    newest = next((s for s in reversed(steps) if s in good or _checked(storage, s, good)), None)
    if newest is None:
        return None
    protected = protected_keys(storage)
    for step in steps:
        if step >= newest:
            return None
        if step in protect or foreign(storage, step):
            continue
        if any(info.key in protected for info in storage.list(f"{checkpoint_key(step)}/")):
            continue  # an aside record names its objects: never deleted, so nothing freed
        if step not in good and not _checked(storage, step, good):
            continue
        freed = _allocated(storage.root / checkpoint_key(step))
        delete_checkpoint(storage, step, protected=protected)
        good.discard(step)
        return Room(deleted=step, freed_bytes=freed, newest_verified=newest)
    return None


def _checked(storage: FileStorage, step: int, good: set[int]) -> bool:
    if not usable(storage, step, sizes_only=False):
        return False
    good.add(step)
    return True


def _allocated(path: Path) -> int:
    """Bytes of disk the files under `path` take (st_blocks: what deleting them frees)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total
