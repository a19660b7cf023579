"""manifest.json: what a committed checkpoint contains and how to check it.

The manifest is written last; a checkpoint without a valid manifest does not exist. Paths in
`files` are relative to the checkpoint directory and may never escape it.

Long (about 350 lines): the fields, their bounds (`validate`) and the schema migrations are one
format and change together.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from runner.checkpoint.chunk_digests import Chunk, listed_chunks
from runner.errors import IntegrityError, SchemaError

# "3": the size-chunked layout of one process's state is named `torch-chunked` (schema 2 called
# it `torch-sharded`, a name kept free for per-rank shards). A manifest is written with the
# lowest schema that expresses it (`schema_for`), so a runner that reads only 1 and 2 still
# reads every torch-state and seed-bin checkpoint, and refuses a torch-chunked one as a newer
# runner's instead of misreading its format.
# "4": `torch-dcp`, one checkpoint written by every rank of a torchrun job (DCP's files, one
# train state, a file per rank); a runner that reads up to 3 refuses it as a newer runner's.
# "5": `files`, a trainer's own checkpoint (a file or a directory tree) held byte for byte
# (`runner run --adopt`); a runner that reads up to 4 refuses it as a newer runner's.
SCHEMA_VERSION = "5"  # the newest this runner reads and writes
SUPPORTED_SCHEMAS = ("1", "2", "3", "4", "5")

FORMAT_TORCH = "torch-state"  # one state.pt loadable with torch.load(weights_only=True)
FORMAT_CHUNKED = "torch-chunked"  # index.json + skeleton.pt + N size-chunk files
FORMAT_SEED_BIN = "seed-bin"  # step_NNNNNN.bin from the seed format
FORMAT_DCP = "torch-dcp"  # .metadata + __R_I.distcp (torch.distributed.checkpoint) + rank files
FORMAT_FILES = "files"  # a trainer's own file or directory, byte for byte, under its own name
# What schemas 1 and 2 called FORMAT_CHUNKED (their layout: index schema "1", shard_NNNNN.pt).
# In memory such a checkpoint is FORMAT_CHUNKED with schema "2", written back under this name.
LEGACY_FORMAT_SHARDED = "torch-sharded"
# The formats schema 2 names with the meaning schema 3 gives them: stated as "2" whatever
# schema a manifest of theirs claims.
_SCHEMA_2_FORMATS = (FORMAT_TORCH, FORMAT_SEED_BIN)
# The formats each schema after 3 added, and only they: written with it, and it names no other.
_ADDED_BY = {"4": FORMAT_DCP, "5": FORMAT_FILES}


def schema_for(format: str) -> str:
    """The schema a new checkpoint of `format` is written with: the lowest that names it."""
    if format in _SCHEMA_2_FORMATS:
        return "2"
    return next((schema for schema, added in _ADDED_BY.items() if added == format), "3")


_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# What a manifest may claim, so a hostile one cannot exhaust memory or time: readers read at
# most MAX_MANIFEST_BYTES before parsing, and `validate` bounds the rest. Real manifests are
# far below every limit (a 1000-chunk checkpoint's manifest is ~150 KiB).
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_FILES = 100_000
MAX_PATH_CHARS = 1024
MAX_PATH_PART_CHARS = 255
MAX_STEP = 10**12  # a trillion optimizer updates: no real run gets near it
MAX_COUNTER = 2**62  # samples_seen and friends: fit an int64 with room to spare
MAX_WORLD_SIZE = 2**20
MAX_FILE_SIZE = 2**50  # 1 PiB per file


@dataclass(frozen=True, kw_only=True, slots=True)
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass(kw_only=True, slots=True)
class Manifest:
    """One checkpoint's manifest. `schema` is the lowest schema that expresses it, what it is
    written back with: "2" for torch-state and seed-bin and for a torch-chunked one read from
    schema 2 (the torch-sharded layout), "3" for other torch-chunked ones."""

    schema: str
    step: int
    samples_seen: int
    world_size: int = 1
    epoch: int = 0
    batch_in_epoch: int = 0
    created_at: str = field(default_factory=lambda: utc_now_iso())
    run_id: str
    writer: str
    format: str
    fingerprint: str
    files: list[FileEntry] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        data = asdict(self)
        if self.schema == "2" and self.format == FORMAT_CHUNKED:
            data["format"] = LEGACY_FORMAT_SHARDED  # as schema 2 names it: the bytes it had
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def chunks(self, *, source: str = "manifest.json") -> dict[str, list[Chunk]]:
        """The chunks of each file the writer hashed in chunks (runner.checkpoint.chunk_digests);
        checked when the manifest was, so a manifest that parsed never raises here."""
        return listed_chunks(self.extra, {f.path: f.size for f in self.files}, source=source)

    @classmethod
    def from_json(cls, raw: bytes, *, source: str = "manifest.json") -> Manifest:
        """Parse, migrate to the lowest schema that expresses it (`migrate`) and validate.
        Raises IntegrityError/SchemaError.

        `raw` longer than MAX_MANIFEST_BYTES is refused before parsing; readers should not
        read more than that in the first place (see `runner.checkpoint.listing`)."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise IntegrityError(
                f"{source}: {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may "
                "have; not a spot-runner manifest, refusing to parse it"
            )
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            # ValueError: JSONDecodeError, and integers past Python's digit limit;
            # RecursionError: absurdly deep nesting
            raise IntegrityError(
                f"{source}: not valid JSON ({type(exc).__name__}: {str(exc)[:200]}); the "
                "checkpoint is corrupt"
            ) from exc
        if not isinstance(data, dict):
            raise IntegrityError(f"{source}: expected a JSON object")
        data = migrate(data, source=source)
        files_raw = data.pop("files", None)
        if not isinstance(files_raw, list):
            raise IntegrityError(
                f"{source}: 'files' must be a list, got {type(files_raw).__name__}"
            )
        if len(files_raw) > MAX_FILES:
            raise IntegrityError(
                f"{source}: lists {len(files_raw)} files, more than the {MAX_FILES} a checkpoint "
                "may have; refusing it"
            )
        try:
            files = [FileEntry(**f) for f in files_raw]
            manifest = cls(files=files, **data)
        except (TypeError, KeyError) as exc:
            raise IntegrityError(f"{source}: missing or unknown field ({exc})") from exc
        manifest.validate(source=source)
        return manifest

    def validate(self, *, source: str = "manifest.json") -> None:
        """The bounds of verification rule 1 (runner.checkpoint.verify): the schema, then the
        counters and fields, then the file list."""
        if self.schema not in ("2", "3", *_ADDED_BY):
            raise SchemaError(f"{source}: schema {self.schema!r} is not '2', '3', '4' or '5'")
        if self.schema != "2" and self.format in _SCHEMA_2_FORMATS:
            # only a writer can get here (reading states the lowest schema): never write it
            raise SchemaError(
                f"{source}: schema {self.schema!r} for format {self.format!r}, which schema '2' "
                "expresses: a manifest claims the lowest schema it needs"
            )
        for schema, added in _ADDED_BY.items():
            if (self.schema == schema) != (self.format == added):
                # a schema after 3 adds one format: neither is written with another's schema
                raise SchemaError(
                    f"{source}: schema {self.schema!r} for format {self.format!r}: format "
                    f"{added!r} is schema {schema!r} and schema {schema!r} names no other new "
                    "format"
                )
        self._validate_fields(source)
        self._validate_files(source)
        self.chunks(source=source)

    def _validate_fields(self, source: str) -> None:
        limits = {
            "step": MAX_STEP,
            "samples_seen": MAX_COUNTER,
            "world_size": MAX_WORLD_SIZE,
            "epoch": MAX_COUNTER,
            "batch_in_epoch": MAX_COUNTER,
        }
        for name, limit in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise IntegrityError(
                    f"{source}: {name} must be a non-negative integer, got {value!r}"
                )
            if value >= limit:
                raise IntegrityError(
                    f"{source}: {name} {value} is implausible (must be < {limit}); the "
                    "manifest is corrupt or forged"
                )
        if self.world_size < 1:
            raise IntegrityError(f"{source}: world_size must be >= 1")
        for name in ("schema", "created_at", "run_id", "writer", "format", "fingerprint"):
            if not isinstance(getattr(self, name), str):
                raise IntegrityError(f"{source}: {name} must be a string")
        if not isinstance(self.extra, dict):
            raise IntegrityError(f"{source}: extra must be an object")

    def _validate_files(self, source: str) -> None:
        if not isinstance(self.files, list) or not self.files:
            raise IntegrityError(f"{source}: lists no files")
        if len(self.files) > MAX_FILES:
            raise IntegrityError(
                f"{source}: lists {len(self.files)} files, more than the {MAX_FILES} a "
                "checkpoint may have; refusing it"
            )
        seen: set[str] = set()
        for entry in self.files:
            check_relative_path(entry.path, source=source)
            if entry.path in seen:
                raise IntegrityError(f"{source}: file {entry.path!r} listed twice")
            seen.add(entry.path)
            if (
                not isinstance(entry.size, int)
                or isinstance(entry.size, bool)
                or not 0 <= entry.size < MAX_FILE_SIZE
            ):
                raise IntegrityError(
                    f"{source}: bad size {entry.size!r} for {entry.path!r} (must be an integer "
                    f">= 0 and < {MAX_FILE_SIZE})"
                )
            if not isinstance(entry.sha256, str) or not _SHA256.match(entry.sha256):
                raise IntegrityError(f"{source}: bad sha256 for {entry.path!r}")


def check_relative_path(path: str, *, source: str = "manifest.json") -> str:
    """Refuse absolute paths and paths that resolve outside the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise IntegrityError(f"{source}: empty or non-string file path {path!r}")
    if len(path) > MAX_PATH_CHARS or any(len(p) > MAX_PATH_PART_CHARS for p in path.split("/")):
        raise IntegrityError(
            f"{source}: file path {path[:80]!r}... is longer than {MAX_PATH_CHARS} characters "
            f"(or has a part over {MAX_PATH_PART_CHARS}); refusing to read it"
        )
    if (
        path.startswith(("/", "\\"))
        or re.match(r"^[A-Za-z]:", path)
        or "\\" in path
        or "\0" in path
    ):
        raise IntegrityError(
            f"{source}: file path {path!r} is absolute or malformed; refusing to read it"
        )
    normalised = posixpath.normpath(path)
    if normalised.startswith("..") or normalised == "." or normalised != path:
        raise IntegrityError(
            f"{source}: file path {path!r} escapes or is not canonical inside the checkpoint "
            "directory; refusing to read it"
        )
    return normalised


def created_at_unix(created_at: str) -> float | None:
    """UNIX time of a manifest's `created_at`, None when it cannot be parsed."""
    try:
        return datetime.fromisoformat(created_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def utc_now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def migrate(data: dict[str, Any], *, source: str) -> dict[str, Any]:
    """Bring a manifest dict from any supported schema to the in-memory form (1 -> 2, then the
    format's current name): `schema` becomes the lowest that expresses it (see `Manifest`).

    A version this runner does not know is a SchemaError (possibly a newer runner's: kept,
    never replaced); a manifest that names no version at all is malformed or not ours, an
    IntegrityError (corrupt: it may be replaced or set aside like any corrupt checkpoint)."""
    field_name = "schema" if "schema" in data else "version"  # v1 called it `version`
    raw = data.get(field_name)
    if (
        field_name not in data
        or isinstance(raw, bool)
        or not isinstance(raw, str | int)
        or not str(raw)
    ):
        what = (
            "has no 'schema' field"
            if field_name not in data
            else f"has a malformed {field_name!r} field ({str(raw)[:40]!r})"
        )
        raise IntegrityError(
            f"{source}: {what}: not a manifest spot-runner writes (each names its schema; this "
            f"runner reads {', '.join(SUPPORTED_SCHEMAS)}), so the checkpoint is corrupt"
        )
    schema = str(raw)
    if schema not in SUPPORTED_SCHEMAS:
        newer = schema.isdigit() and len(schema) < 10 and int(schema) > int(SCHEMA_VERSION)
        hint = (
            "a newer spot-runner wrote it: upgrade to read it"
            if newer
            else "not written by any spot-runner this one knows"
        )
        raise SchemaError(
            f"{source}: unknown schema version {schema!r} (this runner reads "
            f"{', '.join(SUPPORTED_SCHEMAS)}); {hint}"
        )
    if schema == "1":
        try:
            data = _migrate_v1_to_v2(data)
        except (TypeError, ValueError, AttributeError) as exc:
            raise IntegrityError(f"{source}: malformed v1 manifest ({exc})") from exc
        schema = "2"
    return _lowest_schema(data, schema)


def _lowest_schema(data: dict[str, Any], schema: str) -> dict[str, Any]:
    """Schema 2's `torch-sharded` is `torch-chunked` in memory, still schema "2" (its layout,
    shard_NNNNN.pt and index schema "1", is schema 2's; the chunked reader reads either); a
    schema-3 torch-state or seed-bin manifest (the runner between the rename and this rule
    wrote them) is stated as "2"; a schema-2 one naming `torch-chunked`, schema 3's name, as
    "3". Any other format keeps its schema (and is refused as unknown when read). Nothing else
    differs between 2 and 3; `extra` is left as it was (no `migrated_from`: the counters a v2
    manifest stores are all five)."""
    data = dict(data)
    fmt = data.get("format")
    if schema == "2" and fmt == LEGACY_FORMAT_SHARDED:
        data["format"] = FORMAT_CHUNKED
    elif fmt == FORMAT_CHUNKED and schema in ("2", *_ADDED_BY):
        schema = "3"
    elif fmt in _SCHEMA_2_FORMATS:
        schema = "2"
    data["schema"] = schema
    return data


def _migrate_v1_to_v2(v1: dict[str, Any]) -> dict[str, Any]:
    """v1 (first layout): `version: 1`, `files` as a {path: {size, sha256}} map, no world size,
    no samples_seen, no run identity. v2 adds them; samples_seen is recovered from the v1
    `batch_size` (samples = step * batch_size * world_size, exact for fixed-size batches).
    `extra.v1_counters` names the counters the v1 manifest really stored (the others are
    defaults or derived), so the payload is compared with those only."""
    data = dict(v1)
    stored = sorted(name for name in V1_MANIFEST_COUNTERS if name in data)
    data.pop("version", None)
    data["schema"] = "2"
    files = data.get("files", {})
    if isinstance(files, dict):
        data["files"] = [{"path": p, **meta} for p, meta in sorted(files.items())]
    batch_size = int(data.pop("batch_size", 0))
    data.setdefault("world_size", 1)
    data.setdefault("samples_seen", int(data.get("step", 0)) * batch_size * data["world_size"])
    data.setdefault("run_id", "migrated-v1")
    data.setdefault("writer", "migrated-v1")
    data.setdefault("fingerprint", "")
    data.setdefault("extra", {})
    data["extra"] = {**data["extra"], "migrated_from": "1", "v1_counters": stored}
    return data


V1_MANIFEST_COUNTERS = ("step", "epoch", "batch_in_epoch", "world_size", "samples_seen")


def stored_counters(manifest: Manifest) -> tuple[str, ...]:
    """The counters a manifest really records: all five for v2/v3; for one migrated from v1 only
    those the v1 file had (`step` at least), never a default or a derived value."""
    if manifest.extra.get("migrated_from") != "1":
        return V1_MANIFEST_COUNTERS
    # `extra` is part of what a forger can edit: the step is compared whatever it says
    listed = manifest.extra.get("v1_counters")
    if not isinstance(listed, list):
        return ("step",)
    return tuple(name for name in V1_MANIFEST_COUNTERS if name == "step" or name in listed)
