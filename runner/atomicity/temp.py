"""Temporary names: every file or directory that is not yet (or no longer) committed is named
with this prefix, so listings, verification and the mirror skip it and stale-file cleanup
finds it.

The runner's names, built here only:

    .tmp-<target>-<pid>-<uuid12>          a file or directory being written (or downloaded)
    .tmp-<target>-<pid>-<tag>-<uuid8>     one being removed (tag `pruned`: retention)

`<target>` is the final name the temp stands for (`step_000025`, `state.pt`, `incoming`),
`<pid>` the process that made it, so cleanup can tell a crashed writer's leftover from a live
one's. Trainers write their own (`.tmp-step_000025.bin-<pid>-<anything>`, or no pid at all):
those are read the way they always were, the pid being the second `-` field.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from runner.system.pids import pid_alive

TMP_PREFIX = ".tmp-"

_TOKEN_LEN = 12
_TAGGED_TOKEN_LEN = 8  # the shape pruned names have always had
_TAG = re.compile(r"[a-z]+")
_RUNNER_SHAPE = re.compile(
    r"(?P<target>.+)-(?P<pid>[0-9]+)-"
    rf"(?:(?P<tag>[a-z]+)-(?P<short>[0-9a-f]{{{_TAGGED_TOKEN_LEN}}})|(?P<token>[0-9a-f]{{{_TOKEN_LEN}}}))"
)
_TRAINER_SHAPE = re.compile(r"(?P<target>[^-]*)-(?P<pid>[0-9]+)-(?P<token>.*)")
# A temp whose owner is alive is still only kept this many times `stale_seconds`: its pid
# may have been reused by an unrelated process.
_REUSED_PID_FACTOR = 10


@dataclass(frozen=True, kw_only=True)
class TempName:
    """What a temp name says. A name in no known shape has its whole rest as `target`."""

    target: str
    pid: int | None
    token: str
    """The part that makes the name unique (a trainer's own suffix in its shape)."""
    tag: str | None = None


def is_temp_name(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


def temp_name(target: str, *, tag: str | None = None) -> str:
    """A fresh temp name for `target`, owned by this process; `tag` (lowercase letters)
    marks why it exists (`pruned`)."""
    if not target or "/" in target:
        raise ValueError(f"a temp name needs a plain final name, not {target!r}")
    pid = os.getpid()
    if tag is None:
        return f"{TMP_PREFIX}{target}-{pid}-{uuid.uuid4().hex[:_TOKEN_LEN]}"
    if not _TAG.fullmatch(tag):
        raise ValueError(f"a temp name's tag is lowercase letters, not {tag!r}")
    return f"{TMP_PREFIX}{target}-{pid}-{tag}-{uuid.uuid4().hex[:_TAGGED_TOKEN_LEN]}"


def temp_path(final: Path, *, tag: str | None = None) -> Path:
    """A fresh temp path beside `final` (same filesystem, so the rename is atomic)."""
    return final.with_name(temp_name(final.name, tag=tag))


def parse_temp_name(name: str) -> TempName | None:
    """What `name` says, or None when it is not a temp name. The runner's own shapes are
    matched from the right (a target may hold `-`); any other keeps its old reading."""
    if not is_temp_name(name):
        return None
    rest = name[len(TMP_PREFIX) :]
    if m := _RUNNER_SHAPE.fullmatch(rest):
        token = m["token"] if m["tag"] is None else m["short"]
        return TempName(target=m["target"], pid=int(m["pid"]), token=token, tag=m["tag"])
    if m := _TRAINER_SHAPE.fullmatch(rest):
        return TempName(target=m["target"], pid=int(m["pid"]), token=m["token"])
    return TempName(target=rest, pid=None, token="")


def last_modified(path: Path) -> float:
    """Newest mtime of the entry and, for a dir, its direct children (a file growing inside a
    dir does not touch the dir's own mtime). Now, when it is gone."""
    try:
        newest = path.stat().st_mtime
        if path.is_dir():
            for child in path.iterdir():
                try:
                    newest = max(newest, child.stat().st_mtime)
                except FileNotFoundError:
                    continue
    except FileNotFoundError:
        return time.time()
    return newest


def is_stale_temp(path: Path, *, stale_seconds: float, now: float | None = None) -> bool:
    """Whether a temp entry is a leftover to remove. The caller has already set aside the
    temps it is still writing; of the rest, one is stale when this process made it, when its
    owner pid is gone and it has been idle for `stale_seconds` (a pid from another host or
    container sharing the volume may look gone), or when it has been idle for ten times that
    (a live pid reused by an unrelated process)."""
    parsed = parse_temp_name(path.name)
    if parsed is None:
        return False
    idle = (time.time() if now is None else now) - last_modified(path)
    mine = parsed.pid == os.getpid()
    dead = parsed.pid is not None and not mine and not pid_alive(parsed.pid)
    return mine or (dead and idle > stale_seconds) or idle > _REUSED_PID_FACTOR * stale_seconds


def remove_temp(path: Path) -> None:
    """Remove a temp file or directory (a link itself, never what it points at)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
