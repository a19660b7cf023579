"""The `files` format: a trainer's own checkpoint, one file or a directory tree, held byte for
byte under its own name (`runner run --adopt`).

A checkpoint of `out/checkpoint-500` is `step_000500/checkpoint-500/<its files>` with every
file in the manifest (size, sha256) and `extra.source` = `out/checkpoint-500`, the path
relative to the trainer's working directory it is restored to. Only regular files are held:
a tree with a symlink, a socket or a device in it is refused whole (`NotAdoptableError`), and
empty directories are not kept. No fingerprint: the bytes are the state.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from runner.atomicity.files import HashingFileWriter, fsync_dir, read_chunks, sha256_file
from runner.atomicity.temp import temp_path
from runner.checkpoint.manifest import FORMAT_FILES, Manifest, check_relative_path
from runner.errors import IntegrityError, RunnerError

log = logging.getLogger(__name__)

_DIGITS = re.compile(r"\d+")
SOURCE_KEY = "source"
"""`extra` key: the checkpoint's path relative to the trainer's working directory."""
KIND_KEY = "source_kind"
"""`extra` key: "file" or "dir"."""
ASIDE_MARK = ".runner-aside"
"""A trainer's file that a restore found in the way, renamed `.NAME.runner-aside[-N]` beside
it: hidden (a glob's `*` and Hugging Face's checkpoint search pass dot names over), kept."""


class NotAdoptableError(RunnerError):
    """A match that cannot be held byte for byte (a symlink or special file in it)."""


def step_in_name(name: str) -> int | None:
    """The step a trainer wrote into a checkpoint's name: its last integer
    (`checkpoint-500`, `epoch=0-step=500.ckpt`, `ckpt-000500.pt`); None when it has none."""
    found = _DIGITS.findall(name)
    return int(found[-1]) if found else None


@dataclass(frozen=True, kw_only=True)
class TreeFile:
    rel: str
    """Its manifest path: the match's own name, then the path inside it (`checkpoint-500/a.pt`)."""
    path: Path
    size: int
    mtime_ns: int
    inode: int


def list_tree(match: Path) -> list[TreeFile]:
    """The regular files of `match` (a file, or a directory walked whole), sorted.
    FileNotFoundError when it vanished; NotAdoptableError for anything but regular files and
    directories in it."""
    top = match.name
    if match.is_symlink():
        raise NotAdoptableError(f"{match} is a symlink: only files and directories are adopted")
    st = match.stat()
    if not os.path.isdir(match):
        return [_entry(top, match, st)]
    found: list[TreeFile] = []
    for dirpath, dirnames, filenames in os.walk(match, onerror=_raise):
        base = Path(dirpath)
        for name in sorted(dirnames + filenames):
            path = base / name
            inner = path.relative_to(match).as_posix()
            st = path.lstat()
            if os.path.islink(path) or not (_is_dir(st) or _is_file(st)):
                raise NotAdoptableError(
                    f"{path} is a symlink or a special file: a checkpoint is adopted only when "
                    "it holds regular files and directories"
                )
            if _is_file(st):
                found.append(_entry(f"{top}/{inner}", path, st))
    return sorted(found, key=lambda f: f.rel)


def _raise(exc: OSError) -> None:
    raise exc


def _is_dir(st: os.stat_result) -> bool:
    return stat.S_ISDIR(st.st_mode)


def _is_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode)


def _entry(rel: str, path: Path, st: os.stat_result) -> TreeFile:
    return TreeFile(rel=rel, path=path, size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)


Signature = tuple[tuple[str, int, int, int], ...]


def signature(files: Sequence[TreeFile]) -> Signature:
    """What changes when a trainer writes into the tree: a name, a size, an mtime, an inode."""
    return tuple((f.rel, f.size, f.mtime_ns, f.inode) for f in files)


def source_of(manifest: Manifest) -> str:
    """Where a `files` checkpoint came from, relative to the trainer's working directory;
    IntegrityError for a manifest whose `source` is missing or would escape it."""
    source = manifest.extra.get(SOURCE_KEY)
    if manifest.format != FORMAT_FILES or not isinstance(source, str):
        raise IntegrityError(f"step {manifest.step}: a files checkpoint without a source path")
    check_relative_path(source, source=f"step {manifest.step} manifest's source")
    top = PurePosixPath(source).name
    if any(f.path != top and not f.path.startswith(top + "/") for f in manifest.files):
        raise IntegrityError(f"step {manifest.step}: its files are not all under {top!r}")
    return source


@dataclass(frozen=True, kw_only=True)
class Restored:
    path: Path
    copied: bool
    """False when the path already held these bytes."""
    aside: Path | None = None
    """Where what was in the way went."""


def restore(step_dir: Path, manifest: Manifest, *, root: Path) -> Restored:
    """Put a verified `files` checkpoint back at `root / source`, byte-identical: left as it
    is when it already holds these bytes, otherwise copied beside it under a temp name (each
    file hashed as it is written) and renamed into place; what was in the way is renamed
    aside (`ASIDE_MARK`), never deleted."""
    source = source_of(manifest)
    dest = root / source
    top = PurePosixPath(source).name
    if _holds(dest, manifest):
        return Restored(path=dest, copied=False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dest)
    is_dir = manifest.extra.get(KIND_KEY) == "dir" or any("/" in f.path for f in manifest.files)
    try:
        if is_dir:
            tmp.mkdir()
        for entry in manifest.files:
            inner = entry.path[len(top) + 1 :] if is_dir else ""
            out_path = tmp / inner if is_dir else tmp
            out_path.parent.mkdir(parents=True, exist_ok=True)
            with open(step_dir / entry.path, "rb") as f, HashingFileWriter(out_path) as out:
                for chunk in read_chunks(f):
                    out.write(chunk)
                if (out.size, out.digest_so_far()) != (entry.size, entry.sha256):
                    raise IntegrityError(
                        f"{step_dir / entry.path} changed since it was verified; not restored"
                    )
                out.commit(sync_dir=False)
        if is_dir:
            for dirpath, _, _ in os.walk(tmp):
                fsync_dir(Path(dirpath))
        aside = _move_aside(dest)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        _remove(tmp)
        raise
    return Restored(path=dest, copied=True, aside=aside)


def _holds(dest: Path, manifest: Manifest) -> bool:
    """Does `dest` hold exactly the checkpoint's files (names, sizes, then sha256)?"""
    try:
        present = list_tree(dest)
    except (OSError, NotAdoptableError):
        return False
    wanted = {f.path: f for f in manifest.files}
    if {f.rel for f in present} != set(wanted) or any(
        f.size != wanted[f.rel].size for f in present
    ):
        return False
    return all(sha256_file(f.path) == (f.size, wanted[f.rel].sha256) for f in present)


def _move_aside(dest: Path) -> Path | None:
    if not (dest.exists() or dest.is_symlink()):
        return None
    aside = dest.with_name(f".{dest.name}{ASIDE_MARK}")
    n = 0
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = dest.with_name(f".{dest.name}{ASIDE_MARK}-{n}")
    os.rename(dest, aside)
    log.warning(
        "%s did not hold the verified checkpoint being restored there: it was renamed to %s "
        "(kept, not deleted)",
        dest,
        aside,
    )
    return aside


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
