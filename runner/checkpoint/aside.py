"""Setting checkpoints aside: how an unusable checkpoint gets out of the way without being lost.

Nothing that might be someone's last good checkpoint is ever deleted or overwritten by a
decision of the runner. When a checkpoint must stop counting (it failed verification and a
good copy of its step is about to be committed, or `--fresh-start` was asked for), it is set
aside instead:

- in a run dir, its directory (or seed `.bin`) is renamed into `RUN_DIR/aside/`, bytes
  untouched; nothing there is ever deleted by the runner;
- in a mirror, it is *de-committed*: a copy of its manifest goes to
  `PREFIX/aside/step_N-<when>-<why>/decommitted-manifest.json`, then the step's manifest is
  deleted (the manifest is the commit marker, so the checkpoint stops existing while its
  payload objects stay where they are). Every record that is not `corrupt` (`foreign`: a
  newer schema or a format this runner does not read; `superseded-by-rescale`: an older state
  a re-base renumbered; any other) protects the objects it names from retention and the orphan
  sweep, even after a later lineage commits and prunes that step again (`protected_keys`); a
  `corrupt` one does not, so its payload goes with the step's next retention or the sweep.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from runner.atomicity.files import fsync_dir
from runner.checkpoint.layout import CHECKPOINTS_DIR, manifest_key, parse_step_dir, step_dir_name
from runner.errors import RunnerError, StorageConflictError, StorageNotFoundError
from runner.storage.base import ObjectInfo, Storage

log = logging.getLogger(__name__)

ASIDE_DIR = "aside"
# The record of a de-committed mirror checkpoint. Not `manifest.json`: a run dir's aside/
# holds whole checkpoint directories (with their own manifest.json, paths relative to
# themselves), and those must never be read as records naming objects under checkpoints/.
ASIDE_MANIFEST = "decommitted-manifest.json"
CORRUPT = "corrupt"
"""Failed size/sha256 (or self-consistency) checks: worthless, kept only for inspection."""
FOREIGN = "foreign"
"""Verified or unreadable by this runner (newer schema, unknown format, refused payload):
possibly good for another version of the trainer, so its bytes are protected."""
# A manifest is small; an aside record bigger than this is not read for protected names.
_MAX_RECORD_BYTES = 16 << 20


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")


def aside_name(name: str, reason: str) -> str:
    """`step_000025-20261201T103000123456Z-corrupt`: sorts by step, then by when."""
    return f"{name}-{_stamp()}-{reason}"


def set_aside_local(run_dir: Path, path: Path, *, reason: str, name: str | None = None) -> Path:
    """Rename a checkpoint directory or file of `run_dir` into `run_dir/aside/` (same
    filesystem: one rename, no byte copied) and return where it went. `name` (default: the
    path's own) starts the new name."""
    aside_root = Path(run_dir) / ASIDE_DIR
    aside_root.mkdir(parents=True, exist_ok=True)
    target = aside_root / aside_name(name or path.name, reason)
    os.rename(path, target)
    fsync_dir(path.parent)
    fsync_dir(aside_root)
    log.warning("set %s aside as %s (%s): kept, never deleted by the runner", path, target, reason)
    return target


def decommit_remote(
    storage: Storage, step: int, *, reason: str, expected: bytes | None = None
) -> str | None:
    """De-commit a mirror's checkpoint: copy its manifest aside, then delete the original.
    Returns the aside record's key, None when the manifest is already gone (another node
    de-committed it). `expected`: the manifest bytes the caller judged; when the step now
    holds another manifest (a good upload landed meanwhile) nothing is deleted and
    StorageConflictError is raised. Raises StorageError when the copy cannot be written
    (the checkpoint then stays committed: nothing is deleted before its record exists)."""
    key_now = manifest_key(step)
    try:
        if storage.head(key_now).size > _MAX_RECORD_BYTES:
            # no manifest of ours is that large: keep a note, not gigabytes in memory
            raw = b'{"note": "the de-committed manifest was too large to copy"}\n'
        else:
            raw = storage.get_bytes(key_now)
    except StorageNotFoundError:
        return None
    if expected is not None and raw != expected:
        raise StorageConflictError(
            f"{storage.uri}/{key_now} changed while it was being judged (another writer "
            "replaced it); not de-committing it"
        )
    key = f"{ASIDE_DIR}/{aside_name(step_dir_name(step), reason)}/{ASIDE_MANIFEST}"
    storage.put_bytes(key, raw, if_absent=True)
    # the narrowest window left: re-read just before the delete (object stores have no
    # compare-and-delete every backend supports)
    if expected is not None:
        try:
            if storage.get_bytes(key_now) != expected:
                raise StorageConflictError(
                    f"{storage.uri}/{key_now} changed while it was being de-committed; left "
                    "in place (its earlier version is recorded at " + key + ")"
                )
        except StorageNotFoundError:
            return key
    storage.delete(key_now)
    log.warning(
        "de-committed checkpoint step %d in %s (%s): its manifest is kept as %s/%s%s",
        step,
        storage.uri,
        reason,
        storage.uri,
        key,
        "" if reason == CORRUPT else " and its files are protected",
    )
    return key


class ProtectedKeys:
    """The objects under `checkpoints/` that aside records protect: `key in protected`.

    `keys`: what readable non-corrupt records name; `steps`: steps with a record that cannot be
    read (every object under them is kept: the record might name any); `everything`: a record
    whose step cannot be told either. `kept` collects what retention and the sweep spared
    because of them (key -> size), for their reports."""

    def __init__(
        self,
        keys: Iterable[str] = (),
        *,
        steps: Iterable[int] = (),
        everything: bool = False,
    ) -> None:
        self.keys = frozenset(keys)
        self.steps = frozenset(steps)
        self.everything = everything
        self.kept: dict[str, int] = {}

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        if self.everything or key in self.keys:
            return True
        parts = key.split("/")
        return (
            len(parts) >= 3
            and parts[0] == CHECKPOINTS_DIR
            and parse_step_dir(parts[1]) in self.steps
        )

    def under(self, step: int) -> bool:
        """Whether anything under step N's directory may be protected."""
        base = f"{CHECKPOINTS_DIR}/{step_dir_name(step)}/"
        return self.everything or step in self.steps or any(k.startswith(base) for k in self.keys)

    def spare(self, info: ObjectInfo) -> None:
        self.kept[info.key] = info.size


def protected_keys(storage: Storage) -> ProtectedKeys:
    """What every aside record that is not `corrupt` protects from retention and the orphan
    sweep (read once per prune). A record that cannot be read (not JSON, too large, no file
    list this runner understands, a failed read) keeps every object of its step; one whose step
    cannot be told either keeps everything: never delete what a record might name. A failure
    to list aside/ raises, so nothing is deleted."""
    keys: set[str] = set()
    steps: set[int] = set()
    everything = False
    for info in storage.list(f"{ASIDE_DIR}/"):
        parts = info.key.split("/")
        if len(parts) != 3 or parts[2] != ASIDE_MANIFEST:
            continue  # a run dir's aside/ holds whole checkpoint dirs: nothing to protect there
        name, _, rest = parts[1].partition("-")
        if rest.partition("-")[2] == CORRUPT:
            continue
        step = parse_step_dir(name)
        try:
            own_step, paths = _read_record(storage, info)
            step = step if step is not None else own_step
            if step is None:
                raise ValueError("no step in its name or its manifest")
        except ValueError as exc:
            where = f"step {step}" if step is not None else "every step"
            log.warning(
                "aside record %s/%s cannot be read (%s): keeping every object of %s it might name",
                storage.uri,
                info.key,
                exc,
                where,
            )
            if step is None:
                everything = True
            else:
                steps.add(step)
            continue
        base = f"{CHECKPOINTS_DIR}/{step_dir_name(step)}"
        keys |= {f"{base}/{p}" for p in paths}
    return ProtectedKeys(keys, steps=steps, everything=everything)


def _read_record(storage: Storage, info: ObjectInfo) -> tuple[int | None, list[str]]:
    """(the record's own step, the paths its files list names); ValueError saying why when it
    cannot be read or names its files in a shape this runner does not know."""
    if info.size > _MAX_RECORD_BYTES:
        raise ValueError(f"{info.size} bytes")
    try:
        data = json.loads(storage.get_bytes(info.key))
    except (RunnerError, RecursionError) as exc:  # JSON errors are ValueErrors already
        raise ValueError(str(exc) or type(exc).__name__) from exc
    files = data.get("files") if isinstance(data, dict) else None
    # schema 1 lists files as a {path: meta} map, schema 2 as [{path, ...}]
    if isinstance(files, dict):
        paths = list(files)
    elif isinstance(files, list) and all(isinstance(f, dict) for f in files):
        paths = [f.get("path") for f in files]
    else:
        raise ValueError("no files list in a known shape")
    if not all(isinstance(p, str) for p in paths):
        raise ValueError("a file without a path")
    step = data.get("step")
    return (step if isinstance(step, int) and not isinstance(step, bool) else None), paths
