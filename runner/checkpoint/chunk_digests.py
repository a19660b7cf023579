"""The chunk digests a manifest may carry: `extra["chunk_sha256"]`.

`{"chunk_bytes": N, "files": {path: [sha256 of bytes [0, N), [N, 2N), ...], ...}}` for the
files the writer hashed in chunks (runner.atomicity.chunk_hash), beside each file's
`{path, size, sha256}`. They live in `extra`, which every schema carries and older runners
pass over, so such a manifest keeps its schema and an older runner still verifies it by the
whole-file sha256. This runner checks a file by its chunks, on every core, when they are
listed, and by its sha256 otherwise; both come from the one pass that wrote the bytes.

A malformed entry is a corrupt manifest (IntegrityError), never a reason to trust a file
less checked: a file is listed here only with exactly one digest per chunk of its size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runner.errors import IntegrityError

CHUNK_FIELD = "chunk_sha256"
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 1 << 40
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Chunk:
    """One chunk of a listed file to check: bytes [offset, offset + size) against `sha256`."""

    index: int
    offset: int
    size: int
    sha256: str


def chunk_field(chunk_bytes: int, digests: Mapping[str, list[str]]) -> dict[str, Any]:
    """The `extra` entry for the files hashed in chunks of `chunk_bytes`."""
    return {"chunk_bytes": chunk_bytes, "files": {p: list(d) for p, d in sorted(digests.items())}}


def listed_chunks(
    extra: Mapping[str, Any], sizes: Mapping[str, int], *, source: str
) -> dict[str, list[Chunk]]:
    """Each file's chunks from a manifest's `extra` (none when it lists no chunk digests);
    `sizes` are the manifest's files. IntegrityError when the entry is malformed, names a file
    the manifest does not list, or does not give one digest per chunk of its size."""
    if CHUNK_FIELD not in extra:
        return {}
    raw = extra[CHUNK_FIELD]

    def bad(why: str) -> IntegrityError:
        return IntegrityError(f"{source}: extra.{CHUNK_FIELD} {why}; the manifest is corrupt")

    if not isinstance(raw, dict) or set(raw) != {"chunk_bytes", "files"}:
        raise bad("must be an object of 'chunk_bytes' and 'files'")
    chunk_bytes, files = raw["chunk_bytes"], raw["files"]
    if (
        not isinstance(chunk_bytes, int)
        or isinstance(chunk_bytes, bool)
        or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES
    ):
        raise bad(f"chunk_bytes {chunk_bytes!r} is not an integer in [{MIN_CHUNK_BYTES}, 2**40]")
    if not isinstance(files, dict):
        raise bad("files must be an object")
    out: dict[str, list[Chunk]] = {}
    for path, digests in files.items():
        if path not in sizes:
            raise bad(f"names {str(path)[:80]!r}, which the manifest does not list")
        size = sizes[path]
        count = -(-size // chunk_bytes)
        if not isinstance(digests, list) or len(digests) != count:
            got = len(digests) if isinstance(digests, list) else type(digests).__name__
            raise bad(f"gives {got} digests for {path!r}, whose {size} bytes are {count} chunks")
        chunks = []
        for index, digest in enumerate(digests):
            if not isinstance(digest, str) or not _SHA256.match(digest):
                raise bad(f"has a malformed digest for chunk {index} of {path!r}")
            offset = index * chunk_bytes
            chunks.append(Chunk(index, offset, min(chunk_bytes, size - offset), digest))
        out[path] = chunks
    return out
