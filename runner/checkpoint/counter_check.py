"""Rule 4 of verification (runner.checkpoint.verify): the counters inside the payload agree
with the manifest.

step, world_size, samples_seen, epoch, batch_in_epoch for torch-state / torch-chunked /
torch-dcp (read from state.pt, the chunked skeleton or the multi-rank train_state.pt), the
header's step for seed-bin. Only counters both
sides really store are compared (a migrated v1 manifest or payload lacks some).

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
import json
import logging
import struct
from pathlib import Path

from runner.checkpoint.layout import ATTEMPT_FIELD, parse_seed_bin
from runner.checkpoint.listing import open_local
from runner.checkpoint.manifest import (
    FORMAT_CHUNKED,
    FORMAT_DCP,
    FORMAT_SEED_BIN,
    FORMAT_TORCH,
    FileEntry,
    Manifest,
    check_relative_path,
    stored_counters,
)
from runner.checkpoint.payload import STATE_FILE, migrate_payload, payload_schema
from runner.checkpoint.safe_load import load_local, torch_load_bytes
from runner.errors import IntegrityError
from runner.storage.base import Storage

log = logging.getLogger(__name__)

# = runner.checkpoint.formats.chunked.INDEX_NAME (that module imports torch)
INDEX_FILE = "index.json"
# A remote (non-local) torch-state payload at most this big is read a second time after
# hashing so its counters can be checked; larger ones are checked on download and on load.
REMOTE_COUNTER_CHECK_MAX_BYTES = 64 * 1024 * 1024
# = runner.checkpoint.formats.dcp.TRAIN_STATE_FILE: a multi-rank checkpoint's shared part
DCP_TRAIN_STATE_FILE = "train_state.pt"
# A chunked index or skeleton is metadata; one bigger than this is not a spot-runner one.
MAX_SHARD_METADATA_BYTES = 256 * 1024 * 1024
_COUNTERS = ("step", "world_size", "samples_seen", "epoch", "batch_in_epoch")
_V1_PAYLOAD_COUNTERS = ("step", "epoch", "batch_in_epoch", "world_size")  # no samples_seen
_SEED_HEADER = struct.Struct("<ii")  # runner.checkpoint.formats.seedbin.HEADER


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
        raw = load_local(step_dir, entry.path)
        check_counters(manifest, payload_counters(raw, source=source), source=source)
    elif manifest.format == FORMAT_CHUNKED:
        index = _listed(manifest, prefix + INDEX_FILE, source=source)
        with open_local(step_dir, index.path) as f:
            index_raw = f.read(MAX_SHARD_METADATA_BYTES + 1)
        skeleton = _chunked_skeleton(manifest, index_raw, prefix=prefix, source=source)
        raw = load_local(step_dir, skeleton.path)
        check_counters(manifest, payload_counters(raw, source=source), source=source)
    elif manifest.format == FORMAT_DCP:
        entry = _listed(manifest, prefix + DCP_TRAIN_STATE_FILE, source=source)
        raw = load_local(step_dir, entry.path)
        check_counters(manifest, payload_counters(raw, source=source), source=source)
    elif manifest.format == FORMAT_SEED_BIN:
        for entry in _seed_files(manifest):
            with open_local(step_dir, entry.path) as f:
                header = f.read(_SEED_HEADER.size)
            _check_seed_header(manifest, entry, header, source=str(step_dir / entry.path))


def check_remote_counters(storage: Storage, base: str, manifest: Manifest) -> None:
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
        raw = torch_load_bytes(data, source=f"{source}/{entry.path}")
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
        raw = torch_load_bytes(data, source=f"{source}/{skeleton.path}")
    elif manifest.format == FORMAT_DCP:
        shared = _listed(manifest, prefix + DCP_TRAIN_STATE_FILE, source=source)
        data = fetch(shared, MAX_SHARD_METADATA_BYTES)
        if data is None:
            raise IntegrityError(f"{source}: {shared.path} is too big to be a spot-runner one")
        raw = torch_load_bytes(data, source=f"{source}/{shared.path}")
    elif manifest.format == FORMAT_SEED_BIN:
        for entry in _seed_files(manifest):
            with storage.open_read(f"{base}/{entry.path}") as stream:
                header = stream.read(_SEED_HEADER.size)
            _check_seed_header(manifest, entry, header, source=f"{source}/{entry.path}")
        return
    else:
        return
    check_counters(manifest, payload_counters(raw, source=source), source=source)
