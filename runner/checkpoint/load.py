"""Load a local checkpoint's train state: verified (sizes and sha256 of every file) while it
is deserialised with `torch.load(weights_only=True)` beside the hashing, the state used only
once every byte verified; its counters checked against the manifest, its schema migrated to v2.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from runner.checkpoint.counter_check import check_counters, payload_counters
from runner.checkpoint.layout import MANIFEST_NAME, parse_step_dir
from runner.checkpoint.listing import check_named_step, open_local, read_manifest_dir
from runner.checkpoint.manifest import (
    FORMAT_CHUNKED,
    FORMAT_DCP,
    FORMAT_SEED_BIN,
    FORMAT_TORCH,
    Manifest,
)
from runner.checkpoint.payload import STATE_FILE, migrate_payload
from runner.checkpoint.safe_load import not_loadable, torch_load
from runner.checkpoint.verify import check_sizes, verify_dir
from runner.errors import IntegrityError, SchemaError

T = TypeVar("T")


def read_beside_verify(
    verify: Callable[[], Manifest], read: Callable[[], T]
) -> tuple[Manifest, Future[T]]:
    """`read` on a worker thread while `verify` hashes here; returns what `verify` returned
    and `read`'s finished future (its result or its error).

    Both read the same files, so the disk serves them once between them and the
    deserialising overlaps the hashing (one core each) instead of following it. What `read`
    produced is only handed out once `verify` passed: when `verify` raises, `read` is waited
    for, its outcome dropped, and `verify`'s error raised."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="load") as pool:
        reading = pool.submit(read)
        try:
            manifest = verify()
        except BaseException:
            reading.exception()  # wait: nothing it read outlives a failed verification
            del reading  # the error's traceback keeps this frame, not the state it read
            raise
        reading.exception()
    return manifest, reading


def load_state(
    step_dir: Path,
    *,
    manifest: Manifest | None = None,
    mmap: bool = False,
    verified: bool = False,
) -> dict[str, Any]:
    """Verify a local checkpoint and deserialise its train state beside the hashing
    (`read_beside_verify`; schema migrated to v2), then check its counters against the
    manifest.

    `mmap=True` maps tensors from the file (just read and hashed, so in the page cache)
    instead of copying them: faster and no second copy in memory, but the checkpoint's disk
    space stays in use while those tensors live, even after it is pruned.
    `verified=True`: the caller hashed these files against `manifest` moments ago in this
    process, or hashes them beside this read and uses its result only once they verified
    (the resume walk does, through `read_beside_verify`); only sizes and paths are checked."""
    step_dir = Path(step_dir)
    if verified and manifest is not None:
        check_named_step(
            manifest, parse_step_dir(step_dir.name), source=str(step_dir / MANIFEST_NAME)
        )
        check_sizes(step_dir, manifest)
        return _deserialise(step_dir, manifest, mmap=mmap)
    listed = read_manifest_dir(step_dir) if manifest is None else manifest
    _, reading = read_beside_verify(
        lambda: verify_dir(step_dir, manifest=listed, counters=False),
        lambda: load_state(step_dir, manifest=listed, mmap=mmap, verified=True),
    )
    return reading.result()


def _deserialise(step_dir: Path, manifest: Manifest, *, mmap: bool) -> dict[str, Any]:
    """The train state of a checkpoint whose paths and sizes were checked."""
    listed = {f.path: (f.size, f.sha256) for f in manifest.files}
    source = str(step_dir)
    try:
        if manifest.format == FORMAT_TORCH:
            if STATE_FILE not in listed:
                raise IntegrityError(f"{source}: the manifest does not list {STATE_FILE}")
            with open_local(step_dir, STATE_FILE) as f:
                by_fd = f"/proc/self/fd/{f.fileno()}"
                target = by_fd if mmap and os.path.exists(by_fd) else step_dir / STATE_FILE
                raw = torch_load(target, source=source, mmap=mmap)
        elif manifest.format == FORMAT_CHUNKED:
            from runner.checkpoint.formats.chunked import read_chunked

            raw = read_chunked(step_dir, listed=listed, mmap=mmap)
        elif manifest.format == FORMAT_SEED_BIN:
            raise SchemaError(
                f"{source}: a seed-bin checkpoint holds flat arrays, not a train state; map it "
                "onto a model with runner.checkpoint.formats.seedbin.seed_to_state"
            )
        elif manifest.format == FORMAT_DCP:
            # its train state is split across ranks and DCP's files: only a template (a model
            # and optimizer at the loading world size) puts it back together
            raise SchemaError(
                f"{source}: a torch-dcp checkpoint (written by {manifest.world_size} ranks) is "
                "resumed by a training session at any world size; this command does not read "
                "torch-dcp yet (its tensors: runner.checkpoint.formats.dcp.read_dcp_full)"
            )
        else:
            raise SchemaError(f"{source}: unknown checkpoint format {manifest.format!r}")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
        raise not_loadable(exc, source=source) from exc
    check_counters(manifest, payload_counters(raw, source=source), source=source)
    return migrate_payload(raw, source=source)
