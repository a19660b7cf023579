"""The checkpoint writer: what a save commits (format, manifest, identity), through the local
commit target (runner.checkpoint.target: staged, hashed, manifest last, fsync, rename).

A crash at any instant leaves the previous checkpoints untouched and, at worst, a `.tmp-`
directory that readers ignore and `cleanup_partial` removes. A writer keeps no mutable state
between calls (the only shared fact is the target's process-wide, locked set of temp dirs
being written), so `write_state` can run on a snapshot in a background thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from runner.atomicity.files import (
    read_chunks,
)
from runner.atomicity.temp import is_stale_temp, is_temp_name, remove_temp
from runner.checkpoint.aside import set_aside_local
from runner.checkpoint.chunk_digests import CHUNK_FIELD
from runner.checkpoint.existing import UNREADABLE, Found, LocalStep
from runner.checkpoint.layout import MANIFEST_NAME, parse_step_dir, step_dir_name
from runner.checkpoint.manifest import (
    FORMAT_CHUNKED,
    FORMAT_TORCH,
    FileEntry,
    Manifest,
    schema_for,
)
from runner.checkpoint.payload import STATE_FILE, with_schema
from runner.checkpoint.staging import Staging
from runner.checkpoint.target import LocalTarget, in_flight
from runner.errors import (
    CheckpointConflictError,
    ConfigError,
    IntegrityError,
)

log = logging.getLogger(__name__)

# A temp dir whose owner is not this process is only removed once it has been idle this long:
# its pid may belong to another host or container sharing the volume.
DEFAULT_STALE_SECONDS = 300.0


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    step: int
    samples_seen: int
    world_size: int
    epoch: int
    batch_in_epoch: int
    fingerprint: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class CommittedCheckpoint:
    step: int
    path: Path
    manifest: Manifest
    store_uri: str | None = None
    """None: committed in `path`. A store's URI: committed there alone, by the ranks of
    several nodes (runner.mirror.nodes); `path` is where it would be locally and holds
    nothing, `manifest` is the local form."""


class CheckpointWriter:
    def __init__(
        self,
        ckpt_dir: Path,
        *,
        run_id: str,
        writer_id: str,
        chunk_bytes: int | None = None,
        stale_seconds: float = DEFAULT_STALE_SECONDS,
    ) -> None:
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ConfigError(f"chunk_bytes must be > 0 (got {chunk_bytes})")
        self.ckpt_dir = Path(ckpt_dir)
        self.run_id = run_id
        self.writer_id = writer_id
        self.chunk_bytes = chunk_bytes
        self.stale_seconds = stale_seconds
        self._target = LocalTarget(self.ckpt_dir)

    # -- public API -------------------------------------------------------------------------

    def write_state(self, state: dict[str, Any], *, meta: CheckpointMeta) -> CommittedCheckpoint:
        """Save a train-state dict as `state.pt` (or size chunks past `chunk_bytes`) and commit it.

        `state` is only read: callers may pass a snapshot and keep training meanwhile."""
        from runner.checkpoint.formats import chunked  # keeps this module small

        payload = with_schema(state)
        with self._staging(meta.step) as stage:
            if self.chunk_bytes is not None and chunked.tensor_bytes(payload) > self.chunk_bytes:
                chunked.write_chunked(stage, payload, chunk_bytes=self.chunk_bytes)
                fmt = FORMAT_CHUNKED
            else:
                stage.write_torch(STATE_FILE, payload)
                fmt = FORMAT_TORCH
            return self._commit(stage, meta=meta, format=fmt)

    def adopt_files(
        self,
        files: dict[str, Path],
        *,
        meta: CheckpointMeta,
        format: str,
        copy: bool = False,
        digests: dict[str, tuple[int, str]] | None = None,
    ) -> CommittedCheckpoint:
        """Commit existing files (e.g. a seed .bin a trainer wrote) as a checkpoint.

        They are renamed in (or copied when `copy`, e.g. from another filesystem) and listed in
        the manifest under the given names. Each is hashed in one read, unless the caller
        already hashed it: `digests` maps a name to its (size, sha256), trusted for a rename
        and checked against the copy for a copy."""
        digests = digests or {}
        with self._staging(meta.step) as stage:
            moved: list[tuple[Path, Path]] = []
            try:
                for name, src in files.items():
                    if copy:
                        entry = stage.copy_in(name, src)
                        if name in digests and digests[name] != (entry.size, entry.sha256):
                            raise IntegrityError(f"{src} changed while it was being copied")
                    else:
                        stage.move_in(name, src, digest=digests.get(name))
                        moved.append((stage.path / name, src))
                return self._commit(stage, meta=meta, format=format)
            except BaseException:
                # the files were the caller's: give them back rather than delete them with
                # the staging dir (best effort; a crash here leaves them in the .tmp- dir)
                for inside, src in moved:
                    if inside.exists():
                        os.rename(inside, src)
                raise

    def copy_streams(
        self,
        sources: Mapping[str, Callable[[], BinaryIO]],
        *,
        meta: CheckpointMeta,
        format: str,
        expected: dict[str, tuple[int, str]],
    ) -> CommittedCheckpoint:
        """Commit files read from streams (e.g. another location's checkpoint), checking each
        against its expected (size, sha256) in the same single read; nothing is committed if
        one differs."""
        with self._staging(meta.step) as stage:
            for name, opener in sources.items():
                with opener() as stream, stage.open_file(name) as out:
                    for chunk in read_chunks(stream):
                        out.write(chunk)
                    if (out.size, out.digest_so_far()) != expected[name]:
                        raise IntegrityError(
                            f"{name}: size or sha256 differs from the source manifest "
                            "(the source checkpoint is corrupt)"
                        )
            return self._commit(stage, meta=meta, format=format)

    def cleanup_partial(self) -> list[Path]:
        """Remove `.tmp-*` leftovers of crashed writes, never one still being written.

        A temp dir is removed when this process created it and no longer writes it, when its
        owner pid is gone and it has been idle for `stale_seconds`, or when it has been idle
        for ten times that (a pid reused by an unrelated process)."""
        removed: list[Path] = []
        if not self.ckpt_dir.is_dir():
            return removed
        now = time.time()
        for entry in self.ckpt_dir.iterdir():
            if not is_temp_name(entry.name):
                continue
            if in_flight(entry):
                continue
            if is_stale_temp(entry, stale_seconds=self.stale_seconds, now=now):
                remove_temp(entry)
                removed.append(entry)
                log.info("removed partial checkpoint leftover %s", entry)
        return removed

    def staging(self, step: int) -> contextlib.AbstractContextManager[Staging]:
        """A fresh temp dir for step `step`, removed unless `commit` renamed it into place
        (runner.checkpoint.ranked: rank 0 stages, every rank writes into it)."""
        return self._staging(step)

    def commit(self, stage: Staging, *, meta: CheckpointMeta, format: str) -> CommittedCheckpoint:
        """Write the manifest of `stage.files` last and publish the staged dir."""
        return self._commit(stage, meta=meta, format=format)

    # -- internals --------------------------------------------------------------------------

    def _staging(self, step: int) -> contextlib.AbstractContextManager[Staging]:
        return self._target.staging(step)

    def manifest_for(
        self,
        files: list[FileEntry],
        *,
        meta: CheckpointMeta,
        format: str,
        chunks: dict[str, Any] | None = None,
    ) -> Manifest:
        """The manifest of a checkpoint of `files` (this writer's run and identity), checked;
        `commit` writes it, a multi-node commit puts it in the bucket (runner.mirror.nodes).
        `chunks`: the chunk digests of the files hashed in chunks (`Staging.chunk_field`)."""
        extra = dict(meta.extra)
        if chunks is not None:
            extra[CHUNK_FIELD] = chunks
        manifest = Manifest(
            schema=schema_for(format),  # the lowest that expresses it
            step=meta.step,
            samples_seen=meta.samples_seen,
            world_size=meta.world_size,
            epoch=meta.epoch,
            batch_in_epoch=meta.batch_in_epoch,
            run_id=self.run_id,
            writer=self.writer_id,
            format=format,
            fingerprint=meta.fingerprint,
            files=sorted(files, key=lambda f: f.path),
            extra=extra,
        )
        manifest.validate(source=f"{self.ckpt_dir}/{step_dir_name(meta.step)}/{MANIFEST_NAME}")
        return manifest

    def _commit(self, stage: Staging, *, meta: CheckpointMeta, format: str) -> CommittedCheckpoint:
        manifest = self.manifest_for(
            stage.files, meta=meta, format=format, chunks=stage.chunk_field()
        )
        final = self.ckpt_dir / step_dir_name(meta.step)
        in_place = self._finalize(stage, final, manifest)
        return CommittedCheckpoint(step=meta.step, path=final, manifest=in_place)

    def _finalize(self, stage: Staging, final: Path, manifest: Manifest) -> Manifest:
        """The local target's finalize (manifest last, fsync, rename) under the existing-step
        policy (runner.checkpoint.existing); a conflict sets this save aside (`_refuse`)."""
        staged = stage.path

        def refuse(path: Path, found: Found) -> NoReturn:
            if found.kind == UNREADABLE:
                self._refuse(
                    staged, final, f"it is of a kind this runner does not read ({found.error})"
                )
            existing = found.manifest
            assert existing is not None
            self._refuse(
                staged,
                final,
                f"it verifies and holds another state (fingerprint "
                f"{existing.fingerprint[:12] or '(none)'}, this save "
                f"{manifest.fingerprint[:12] or '(none)'})",
            )

        policy = LocalStep(manifest, refuse=refuse)
        in_place = self._target.finalize(stage, policy)
        if policy.replaced is not None:
            exc, aside = policy.replaced
            log.warning(
                "replaced %s, which failed verification (%s), with a new save; the corrupt "
                "copy is kept as %s",
                final,
                exc,
                aside,
            )
        return in_place

    def _refuse(self, staged: Path, final: Path, why: str) -> NoReturn:
        kept = set_aside_local(
            self.ckpt_dir.parent, staged, reason="not-committed", name=final.name
        )
        raise CheckpointConflictError(
            f"{final} already exists and {why}: a checkpoint that verifies is never replaced. "
            f"This save was not committed; it is kept as {kept}. Two runs may be writing "
            "this run dir, or the run resumed from an older step than it should: check "
            "`runner ls --verify` and use another --run-dir for a new run",
            kept=kept,
        )


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps of local directories that look committed (named step_N with a manifest)."""
    if not ckpt_dir.is_dir():
        return []
    steps = []
    for entry in ckpt_dir.iterdir():
        step = parse_step_dir(entry.name)
        if step is not None and (entry / MANIFEST_NAME).is_file():
            steps.append(step)
    return sorted(steps)
