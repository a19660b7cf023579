"""The hint for a location that holds no checkpoints but looks one or two levels too deep."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

from runner.checkpoint.layout import CHECKPOINTS_DIR, MANIFEST_NAME, parse_seed_bin, parse_step_dir
from runner.errors import RunnerError, StorageNotFoundError
from runner.storage.base import Storage

# How many keys `misplaced_hint` looks at in a remote location before giving up on a hint.
_HINT_LIST_LIMIT = 200


def misplaced_hint(storage: Storage, location: str) -> str | None:
    """For a location with no checkpoints: a sentence saying it is one or two levels too deep
    (a `checkpoints/` directory, or a single step directory) and which LOCATION to give
    instead; None when it does not look like either. Every command that reports "no
    checkpoints" (ls, verify, status) adds it. Best effort: a store error gives no hint."""
    try:
        if _holds_manifest(storage):
            step = parse_step_dir(_last_part(location))
            parent = _parent_location(location, levels=1)
            up = _parent_location(location, levels=2)
            if (
                step is not None
                and parent is not None
                and up is not None
                and _last_part(parent) == CHECKPOINTS_DIR
            ):
                return (
                    f"{location} is one checkpoint directory (it holds {MANIFEST_NAME}), "
                    f"not a run dir or mirror: give {up} (`runner verify {up} --step "
                    f"{step}` checks just this one), or `runner inspect {location}`"
                )
            return (
                f"{location} holds a {MANIFEST_NAME}: it is a checkpoint directory, not a run "
                f"dir or mirror; `runner inspect {location}` shows it"
            )
        kind = _children_kind(storage)
        if kind == "steps" or (kind is None and _last_part(location) == CHECKPOINTS_DIR):
            up = _parent_location(location, levels=1)
            what = "holds step_N directories" if kind == "steps" else f"is named {CHECKPOINTS_DIR}"
            return (
                f"{location} looks like a {CHECKPOINTS_DIR}/ directory (it {what}), one level "
                f"too deep: give {up or 'the location above it'}, the run dir or mirror holding it"
            )
        if kind == "seed-bin":
            return (
                f"{location} holds seed-format step_NNNNNN.bin files, not checkpoint "
                "directories: `runner convert FILE.bin RUN_DIR` makes one of each"
            )
    except (RunnerError, OSError):
        return None
    return None


def _holds_manifest(storage: Storage) -> bool:
    try:
        storage.head(MANIFEST_NAME)
    except StorageNotFoundError:
        return False
    return True


def _children_kind(storage: Storage) -> str | None:
    """ "steps" when the location's top level has step_N directories, "seed-bin" when it has
    step_N.bin files, else None."""
    root = storage.local_path()
    if root is not None:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in os.scandir(root)]
    else:
        names = []
        for count, info in enumerate(storage.list("step_")):
            if count >= _HINT_LIST_LIMIT:
                break
            first, _, rest = info.key.partition("/")
            names.append((first, bool(rest)))
    if any(is_dir and parse_step_dir(name) is not None for name, is_dir in names):
        return "steps"
    if any(not is_dir and parse_seed_bin(name) is not None for name, is_dir in names):
        return "seed-bin"
    return None


def _last_part(location: str) -> str:
    if "://" not in location:  # a plain path: "." and ".." have real names
        return Path(location).absolute().resolve().name
    return location.rstrip("/").rsplit("/", 1)[-1]


def _parent_location(location: str, *, levels: int) -> str | None:
    """`location` with its last `levels` parts removed, in the form it was given (a plain
    path stays a path, a URI keeps its scheme and bucket); None when nothing is left."""
    scheme, sep, rest = location.partition("://")
    if not sep:
        scheme, rest = "", location
    path = rest.rstrip("/")
    for _ in range(levels):
        if scheme == "s3" and "/" not in path:
            return None  # a bucket has no parent to give
        if sep and path in ("", "/"):
            return None
        if not sep and path in ("", ".", "/"):
            path = str(Path(path or ".").absolute())
        head = posixpath.dirname(path)
        path = head if head else "."
    return f"{scheme}://{path}" if sep else path
