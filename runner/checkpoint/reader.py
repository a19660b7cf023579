"""Find, verify and load checkpoints.

Listing and verifying go through the `Storage` protocol, so they work the same on a run dir,
`file://` and `s3://`. Loading is local: sizes and sha256 of every file are checked before
anything is deserialised, and deserialising is `torch.load(weights_only=True)`.

One rule set, two ways to apply it (a local directory is hashed in place on several threads,
any other storage is streamed), shared by every command (`verify`, `status`, `ls --verify`,
`pull`, `push`, resume): a checkpoint verifies when

1. its manifest is at most MAX_MANIFEST_BYTES (no more is read), parses, and stays within the
   bounds `Manifest.validate` sets (files, path lengths, plausible step and sizes);
2. the manifest's step is the step its directory is named after;
3. every listed file is a canonical relative path, present, a regular file and not a symlink
   (nor under a symlinked directory inside the checkpoint), of the listed size and sha256;
4. the counters inside the payload agree with the manifest (`check_counters`): step,
   world_size, samples_seen, epoch, batch_in_epoch for torch-state / torch-chunked (read from
   state.pt or the chunked skeleton), the header's step for seed-bin. Only counters both sides
   really store are compared (a migrated v1 manifest or payload lacks some).

Reading the counters is cheap locally: `torch.load(weights_only=True, mmap=True)` touches the
pickle, not the tensor data. Remotely (s3://) the counter-holding file is read a second time
after hashing, bounded: a seed header is 8 bytes and a chunked skeleton/index is small, but a
torch-state `state.pt` larger than REMOTE_COUNTER_CHECK_MAX_BYTES is not fetched twice just
for its counters: `verify` on such a remote checkpoint checks rules 1-3 and logs that the
counters were not read, and the counters are checked when it is downloaded (before the
directory is published) and again after it is deserialised by `load_state`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import posixpath
import stat
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from runner.atomicity.files import hash_stream
from runner.checkpoint.layout import (
    ATTEMPT_FIELD,
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    checkpoint_key,
    manifest_key,
    parse_seed_bin,
    parse_step_dir,
)
from runner.checkpoint.manifest import (
    FORMAT_CHUNKED,
    FORMAT_SEED_BIN,
    FORMAT_TORCH,
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    check_relative_path,
    stored_counters,
)
from runner.checkpoint.payload import migrate_payload, payload_schema
from runner.errors import (
    IntegrityError,
    PayloadNotLoadableError,
    RunnerError,
    SchemaError,
    StorageNotFoundError,
)
from runner.storage.base import Storage
from runner.storage.file import FileStorage

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
# = runner.checkpoint.formats.chunked.INDEX_NAME (that module imports torch)
INDEX_FILE = "index.json"
# A remote (non-local) torch-state payload at most this big is read a second time after
# hashing so its counters can be checked; larger ones are checked on download and on load.
REMOTE_COUNTER_CHECK_MAX_BYTES = 64 * 1024 * 1024
# A chunked index or skeleton is metadata; one bigger than this is not a spot-runner one.
MAX_SHARD_METADATA_BYTES = 256 * 1024 * 1024
_COUNTERS = ("step", "world_size", "samples_seen", "epoch", "batch_in_epoch")
_V1_PAYLOAD_COUNTERS = ("step", "epoch", "batch_in_epoch", "world_size")  # no samples_seen
_SEED_HEADER = struct.Struct("<ii")  # runner.checkpoint.formats.seedbin.HEADER

SkipCallback = Callable[[int, str], None]


@dataclass
class CheckpointStatus:
    step: int
    ok: bool
    error: str | None
    manifest: Manifest | None


def list_checkpoints(storage: Storage) -> list[int]:
    """Steps that have a manifest, ascending numeric."""
    steps = set()
    for info in storage.list(f"{CHECKPOINTS_DIR}/"):
        parts = info.key.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST_NAME:
            step = parse_step_dir(parts[1])
            if step is not None:
                steps.add(step)
    return sorted(steps)


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
    if isinstance(storage, FileStorage):
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in os.scandir(storage.root)]
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


def read_manifest(storage: Storage, step: int) -> Manifest:
    """The manifest of checkpoint `step` at `storage`, read with a bound (at most
    MAX_MANIFEST_BYTES + 1 bytes ever leave the storage) and checked against the step its
    directory is named after."""
    key = manifest_key(step)
    source = f"{storage.uri}/{key}"
    try:
        raw = read_manifest_bytes(storage, key)
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{source}: manifest is missing") from exc
    manifest = Manifest.from_json(raw, source=source)
    _check_named_step(manifest, step, source=source)
    return manifest


def read_manifest_bytes(storage: Storage, key: str) -> bytes:
    """A manifest's raw bytes, bounded: its size is asked first and one larger than
    MAX_MANIFEST_BYTES is refused unread; then one whole-object read, which the backend
    retries like any other request (a streamed read cut mid-way would not be).
    StorageNotFoundError when absent."""
    source = f"{storage.uri}/{key}"
    if storage.head(key).size > MAX_MANIFEST_BYTES:
        raise IntegrityError(
            f"{source}: larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have; not "
            "read, refusing it"
        )
    raw = storage.get_bytes(key)
    _check_manifest_size(raw, source=source)  # it grew between the two requests
    return raw


def _check_manifest_size(raw: bytes, *, source: str) -> None:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise IntegrityError(
            f"{source}: larger than the {MAX_MANIFEST_BYTES} bytes a manifest may have; not "
            "read further, refusing it"
        )


def _check_named_step(manifest: Manifest, step: int | None, *, source: str) -> None:
    if step is not None and manifest.step != step:
        raise IntegrityError(
            f"{source}: manifest says step {manifest.step}, its directory is named step {step}; "
            "the checkpoint is mislabelled or forged"
        )


def check_remote_sizes(storage: Storage, step: int) -> Manifest:
    """The cheap check of a stored checkpoint: its manifest (bounded, named step) and every
    file it lists present at the listed size; IntegrityError otherwise. No byte is hashed."""
    manifest = read_manifest(storage, step)
    base = checkpoint_key(step)
    for entry in manifest.files:
        where = f"{storage.uri}/{base}/{entry.path}"
        try:
            size = storage.head(f"{base}/{entry.path}").size
        except StorageNotFoundError as exc:
            raise IntegrityError(f"{where}: listed in the manifest but missing") from exc
        if size != entry.size:
            raise IntegrityError(
                f"{where}: size {size} != {entry.size} in the manifest (truncated or replaced)"
            )
    return manifest


def verify_checkpoint(storage: Storage, step: int) -> Manifest:
    """Apply every rule of the module docstring to checkpoint `step` at `storage`.

    A local location (a run dir, `file://`) is checked in place by `verify_dir` (hashed on
    several threads, symlinks refused); any other storage is streamed."""
    if isinstance(storage, FileStorage):
        # FileStorage refuses a symlinked checkpoints/ dir when listing; here the step dir
        # and everything in it are checked without following any symlink
        return verify_dir(storage.root / checkpoint_key(step), step=step)
    manifest = check_remote_sizes(storage, step)
    base = checkpoint_key(step)
    for entry in manifest.files:
        where = f"{storage.uri}/{base}/{entry.path}"
        try:
            with storage.open_read(f"{base}/{entry.path}") as stream:
                _, sha256 = hash_stream(stream)
        except StorageNotFoundError as exc:
            raise IntegrityError(f"{where}: listed in the manifest but missing") from exc
        if sha256 != entry.sha256:
            raise IntegrityError(f"{where}: sha256 mismatch (the file is corrupt)")
    _check_remote_counters(storage, base, manifest)
    return manifest


def scan(storage: Storage) -> list[CheckpointStatus]:
    """Verify every checkpoint, newest first; a failure is recorded, not raised."""
    statuses = []
    for step in reversed(list_checkpoints(storage)):
        try:
            manifest = verify_checkpoint(storage, step)
        except RunnerError as exc:
            statuses.append(CheckpointStatus(step=step, ok=False, error=str(exc), manifest=None))
        else:
            statuses.append(CheckpointStatus(step=step, ok=True, error=None, manifest=manifest))
    return statuses


def newest_verified(storage: Storage, *, on_skip: SkipCallback | None = None) -> Manifest | None:
    """The newest checkpoint whose files all verify; each newer one skipped is logged and
    reported to `on_skip(step, why)`."""
    for step in reversed(list_checkpoints(storage)):
        try:
            return verify_checkpoint(storage, step)
        except RunnerError as exc:
            log.warning("skipping checkpoint step %d at %s: %s", step, storage.uri, exc)
            if on_skip is not None:
                on_skip(step, str(exc))
    return None


# -- the counters inside the payload ----------------------------------------------------------


def check_counters(
    manifest: Manifest, payload: dict[str, int], *, source: str, what: str = "payload"
) -> None:
    """IntegrityError naming every counter on which the manifest and the payload disagree.
    `payload` holds only the counters the payload really stores; of the manifest only those
    it really stores (`stored_counters`) are compared."""
    in_manifest = stored_counters(manifest)
    mismatches = [
        f"{name}: manifest {getattr(manifest, name)}, {what} {payload[name]}"
        for name in _COUNTERS
        if name in payload and name in in_manifest and payload[name] != getattr(manifest, name)
    ]
    if mismatches:
        raise IntegrityError(
            f"{source}: the manifest and the {what} disagree ({'; '.join(mismatches)}); the "
            "checkpoint is mislabelled or forged, not using it"
        )


def payload_counters(raw: object, *, source: str) -> dict[str, int]:
    """The counters a deserialised payload really stores (schema checked first: an unknown
    one is a SchemaError). v2: its `counters` dict; v1: the flat ones it has (v1 never stored
    samples_seen). A counter that is not an integer is an IntegrityError."""
    migrate_payload(raw, source=source)  # type and schema checks only; the result is unused
    assert isinstance(raw, dict)
    if payload_schema(raw) == "1":
        found = {name: raw[name] for name in _V1_PAYLOAD_COUNTERS if name in raw}
    else:
        counters = raw.get("counters")
        if not isinstance(counters, dict):
            return {}  # restoring refuses it with its own message
        found = {name: counters[name] for name in _COUNTERS if name in counters}
    return {name: _as_int(value, name=name, source=source) for name, value in found.items()}


def _as_int(value: object, *, name: str, source: str) -> int:
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "numel", lambda: 0)() == 1:
        value = item()  # a one-element tensor
    if not isinstance(value, int) or isinstance(value, bool):
        raise IntegrityError(f"{source}: payload counter {name!r} is {value!r}, not an integer")
    return value


def not_loadable(exc: BaseException, *, source: str) -> PayloadNotLoadableError:
    """The error for a payload whose bytes verified but that torch would not deserialise."""
    if isinstance(exc, pickle.UnpicklingError):
        return PayloadNotLoadableError(
            f"{source}: payload holds objects that weights-only loading refuses ({exc}); "
            "it was not written by spot-runner and was not executed"
        )
    return PayloadNotLoadableError(
        f"{source}: payload cannot be deserialised by this torch ({exc})"
    )


def _torch_load(path: Path | str | BinaryIO, *, source: str, mmap: bool) -> Any:
    """torch.load(weights_only=True) with the loader's failures as IntegrityError."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise not_loadable(exc, source=source) from exc


def _attempt_prefix(manifest: Manifest) -> str:
    """A mirror's manifest lists payload files under the upload attempt's directory."""

    attempt = manifest.extra.get(ATTEMPT_FIELD)
    return f"{attempt}/" if isinstance(attempt, str) and attempt else ""


def _listed(manifest: Manifest, path: str, *, source: str) -> FileEntry:
    for entry in manifest.files:
        if entry.path == path:
            return entry
    raise IntegrityError(f"{source}: the manifest does not list {path}")


def _seed_files(manifest: Manifest) -> list[FileEntry]:
    return [e for e in manifest.files if parse_seed_bin(e.path.rsplit("/", 1)[-1]) is not None]


def _check_seed_header(manifest: Manifest, entry: FileEntry, header: bytes, *, source: str) -> None:
    if len(header) < _SEED_HEADER.size:
        raise IntegrityError(f"{source}: too short for the 8-byte seed header")
    step, _ = _SEED_HEADER.unpack(header[: _SEED_HEADER.size])
    named = parse_seed_bin(entry.path.rsplit("/", 1)[-1])
    if named is not None and named != step:
        raise IntegrityError(f"{source}: file name says step {named}, its header step {step}")
    check_counters(manifest, {"step": step}, source=source, what="seed header")


def _chunked_skeleton(
    manifest: Manifest, index_raw: bytes, *, prefix: str, source: str
) -> FileEntry:
    """The manifest entry of the skeleton a chunk index names."""
    try:
        index = json.loads(index_raw)
        skeleton = index["skeleton"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise IntegrityError(f"{source}: unreadable chunk index ({exc})") from exc
    rel = check_relative_path(skeleton, source=source)
    return _listed(manifest, prefix + rel, source=source)


def check_payload_counters(step_dir: Path, manifest: Manifest) -> None:
    """Rule 4 for a local directory whose files were just checked (rule 3): the counters in
    the payload (read mapped: cheap however big the payload) agree with the manifest."""
    prefix = _attempt_prefix(manifest)
    source = str(step_dir)
    if manifest.format == FORMAT_TORCH:
        entry = _listed(manifest, prefix + STATE_FILE, source=source)
        raw = _load_local(step_dir, entry.path)
        check_counters(manifest, payload_counters(raw, source=source), source=source)
    elif manifest.format == FORMAT_CHUNKED:
        index = _listed(manifest, prefix + INDEX_FILE, source=source)
        with _open_local(step_dir, index.path) as f:
            index_raw = f.read(MAX_SHARD_METADATA_BYTES + 1)
        skeleton = _chunked_skeleton(manifest, index_raw, prefix=prefix, source=source)
        raw = _load_local(step_dir, skeleton.path)
        check_counters(manifest, payload_counters(raw, source=source), source=source)
    elif manifest.format == FORMAT_SEED_BIN:
        for entry in _seed_files(manifest):
            with _open_local(step_dir, entry.path) as f:
                header = f.read(_SEED_HEADER.size)
            _check_seed_header(manifest, entry, header, source=str(step_dir / entry.path))
    # an unknown format is refused where it is loaded (SchemaError), not here


def _check_remote_counters(storage: Storage, base: str, manifest: Manifest) -> None:
    """Rule 4 for a streamed storage, each read bounded and re-hashed (see the docstring)."""
    prefix = _attempt_prefix(manifest)
    source = f"{storage.uri}/{base}"

    def fetch(entry: FileEntry, limit: int) -> bytes | None:
        if entry.size > limit:
            return None
        with storage.open_read(f"{base}/{entry.path}") as stream:
            data = stream.read(entry.size + 1)
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise IntegrityError(f"{source}/{entry.path}: changed while it was being verified")
        return data

    if manifest.format == FORMAT_TORCH:
        entry = _listed(manifest, prefix + STATE_FILE, source=source)
        data = fetch(entry, REMOTE_COUNTER_CHECK_MAX_BYTES)
        if data is None:
            log.info(
                "%s: %s is %d bytes; its counters are checked when it is downloaded, not "
                "streamed a second time here",
                source,
                entry.path,
                entry.size,
            )
            return
        raw = _torch_load_bytes(data, source=f"{source}/{entry.path}")
    elif manifest.format == FORMAT_CHUNKED:
        index_raw = fetch(
            _listed(manifest, prefix + INDEX_FILE, source=source), MAX_SHARD_METADATA_BYTES
        )
        if index_raw is None:
            raise IntegrityError(f"{source}: the chunk index is too big to be a spot-runner one")
        skeleton = _chunked_skeleton(manifest, index_raw, prefix=prefix, source=source)
        data = fetch(skeleton, MAX_SHARD_METADATA_BYTES)
        if data is None:
            raise IntegrityError(f"{source}: the skeleton is too big to be a spot-runner one")
        raw = _torch_load_bytes(data, source=f"{source}/{skeleton.path}")
    elif manifest.format == FORMAT_SEED_BIN:
        for entry in _seed_files(manifest):
            with storage.open_read(f"{base}/{entry.path}") as stream:
                header = stream.read(_SEED_HEADER.size)
            _check_seed_header(manifest, entry, header, source=f"{source}/{entry.path}")
        return
    else:
        return
    check_counters(manifest, payload_counters(raw, source=source), source=source)


def _torch_load_bytes(data: bytes, *, source: str) -> Any:
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise not_loadable(exc, source=source) from exc


# -- local ----------------------------------------------------------------------------------


def _dir_storage(step_dir: Path) -> tuple[FileStorage, str]:
    """The no-symlink reader for files of `step_dir`: a FileStorage rooted at its parent, so
    the step directory itself and everything below it are opened with O_NOFOLLOW."""
    step_dir = Path(step_dir).absolute()
    return FileStorage(step_dir.parent), step_dir.name


def _open_local(step_dir: Path, rel: str) -> io.BufferedReader:
    storage, name = _dir_storage(step_dir)
    try:
        return storage.open_read(f"{name}/{rel}")  # type: ignore[return-value]
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{step_dir / rel}: listed in the manifest but missing") from exc


def _load_local(step_dir: Path, rel: str) -> Any:
    """Deserialise a local payload file, mapped (only the pages read are touched) and opened
    without following a symlink: torch maps the already-open file through /proc/self/fd."""
    source = str(step_dir / rel)
    with _open_local(step_dir, rel) as f:
        # only torch's zip format can be mapped; a legacy (pre-1.6) file is read whole
        zipped = f.read(4) == b"PK\x03\x04"
        f.seek(0)
        by_fd = f"/proc/self/fd/{f.fileno()}"
        target = by_fd if os.path.exists(by_fd) else step_dir / rel
        return _torch_load(target if zipped else f, source=source, mmap=zipped)


def read_manifest_dir(step_dir: Path) -> Manifest:
    """The manifest of a local checkpoint directory: not a symlink, at most
    MAX_MANIFEST_BYTES read, and its step the one the directory is named after (a directory
    not named step_N, such as a staging one, is not compared)."""
    step_dir = Path(step_dir)
    source = str(step_dir / MANIFEST_NAME)
    storage, name = _dir_storage(step_dir)
    try:
        with storage.open_read(f"{name}/{MANIFEST_NAME}") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except StorageNotFoundError as exc:
        raise IntegrityError(f"{source}: manifest is missing") from exc
    _check_manifest_size(raw, source=source)
    manifest = Manifest.from_json(raw, source=source)
    _check_named_step(manifest, parse_step_dir(step_dir.name), source=source)
    return manifest


def verify_dir(
    step_dir: Path,
    *,
    manifest: Manifest | None = None,
    step: int | None = None,
    counters: bool = True,
) -> Manifest:
    """Apply every rule of the module docstring to a local checkpoint directory (sizes first,
    a cheap check before hashing; the counters last). `step`: the step the caller expects
    (default: the one in the directory's name). `counters=False` is for `load_state`, which
    checks the counters of what it deserialised instead of reading them twice."""
    step_dir = Path(step_dir)
    if manifest is None:
        manifest = read_manifest_dir(step_dir)
    else:
        _check_named_step(
            manifest, parse_step_dir(step_dir.name), source=str(step_dir / MANIFEST_NAME)
        )
    _check_named_step(manifest, step, source=str(step_dir / MANIFEST_NAME))
    checked = check_sizes(step_dir, manifest)
    # one sha256 cannot be split across cores, but several files (chunks) can be hashed at once
    workers = max(1, min(len(checked), os.cpu_count() or 1, 8))

    def digest(entry: FileEntry) -> str:
        with _open_local(step_dir, entry.path) as f:
            size, sha256 = hash_stream(f)
        if size != entry.size:
            raise IntegrityError(
                f"{step_dir / entry.path}: size {size} != {entry.size} in the manifest "
                "(changed while it was being verified)"
            )
        return sha256

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
        digests = pool.map(lambda item: digest(item[1]), checked)
        for (_, entry), sha256 in zip(checked, digests, strict=True):
            if sha256 != entry.sha256:
                raise IntegrityError(
                    f"{step_dir / entry.path}: sha256 mismatch (the file is corrupt)"
                )
    if counters:
        check_payload_counters(step_dir, manifest)
    return manifest


def check_sizes(step_dir: Path, manifest: Manifest) -> list[tuple[Path, FileEntry]]:
    """Every listed file present, a regular file inside the directory, neither it nor a
    directory on its way (the step directory included) a symlink, and of the listed size (no
    hashing); returns each path with its entry."""
    step_dir = Path(step_dir)
    root = step_dir.resolve()
    _refuse_symlink(step_dir, step_dir)
    paths = []
    for entry in manifest.files:
        rel = check_relative_path(entry.path, source=str(step_dir / MANIFEST_NAME))
        path = step_dir / rel
        current = step_dir
        st: os.stat_result | None = None
        for part in rel.split("/"):
            current = current / part
            try:
                st = current.lstat()
            except (FileNotFoundError, NotADirectoryError) as exc:
                raise IntegrityError(f"{path}: listed in the manifest but missing") from exc
            if stat.S_ISLNK(st.st_mode):
                _refuse_symlink(current, root)
        assert st is not None
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{path}: not a regular file; refusing to read it")
        if st.st_size != entry.size:
            raise IntegrityError(
                f"{path}: size {st.st_size} != {entry.size} in the manifest (truncated or replaced)"
            )
        paths.append((path, entry))
    return paths


def _refuse_symlink(path: Path, root: Path) -> None:
    """IntegrityError when `path` is a symlink (checkpoint writers never create one), saying
    whether it even resolves outside the checkpoint directory `root`."""
    if not path.is_symlink():
        return
    where = (
        "resolves outside the checkpoint directory"
        if not path.resolve().is_relative_to(root.resolve())
        else "points inside the checkpoint directory"
    )
    raise IntegrityError(f"{path}: is a symlink ({where}); refusing to follow it")


def load_state(
    step_dir: Path,
    *,
    manifest: Manifest | None = None,
    mmap: bool = False,
    verified: bool = False,
) -> dict[str, Any]:
    """Verify a local checkpoint, then deserialise its train state (schema migrated to v2)
    and check its counters against the manifest.

    `mmap=True` maps tensors from the file (just read and hashed, so in the page cache)
    instead of copying them: faster and no second copy in memory, but the checkpoint's disk
    space stays in use while those tensors live, even after it is pruned.
    `verified=True`: the caller hashed these files against `manifest` moments ago in this
    process (resolve_resume does); only sizes and paths are checked again."""
    step_dir = Path(step_dir)
    if verified and manifest is not None:
        _check_named_step(
            manifest, parse_step_dir(step_dir.name), source=str(step_dir / MANIFEST_NAME)
        )
        check_sizes(step_dir, manifest)
    else:
        manifest = verify_dir(step_dir, manifest=manifest, counters=False)
    listed = {f.path: (f.size, f.sha256) for f in manifest.files}
    source = str(step_dir)
    try:
        if manifest.format == FORMAT_TORCH:
            if STATE_FILE not in listed:
                raise IntegrityError(f"{source}: the manifest does not list {STATE_FILE}")
            with _open_local(step_dir, STATE_FILE) as f:
                by_fd = f"/proc/self/fd/{f.fileno()}"
                target = by_fd if mmap and os.path.exists(by_fd) else step_dir / STATE_FILE
                raw = _torch_load(target, source=source, mmap=mmap)
        elif manifest.format == FORMAT_CHUNKED:
            from runner.checkpoint.formats.chunked import read_chunked

            raw = read_chunked(step_dir, listed=listed, mmap=mmap)
        elif manifest.format == FORMAT_SEED_BIN:
            raise SchemaError(
                f"{source}: a seed-bin checkpoint holds flat arrays, not a train state; map it "
                "onto a model with runner.checkpoint.formats.seedbin.seed_to_state"
            )
        else:
            raise SchemaError(f"{source}: unknown checkpoint format {manifest.format!r}")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise not_loadable(exc, source=source) from exc
    check_counters(manifest, payload_counters(raw, source=source), source=source)
    return migrate_payload(raw, source=source)


def local_step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / checkpoint_key(step)
