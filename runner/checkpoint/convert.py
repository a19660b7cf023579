"""Seed .bin <-> checkpoint directory, never overwriting anything.

A seed .bin becomes a `seed-bin` checkpoint holding the file byte for byte, so converting it
back yields an identical file. A torch-state or chunked checkpoint is verified, loaded and
streamed out in seed layout one tensor at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.atomicity.files import HashingFileWriter, read_chunks
from runner.checkpoint.formats.seedbin import (
    hash_seed_file,
    read_header,
    write_seed_file,
)
from runner.checkpoint.layout import CHECKPOINTS_DIR, MANIFEST_NAME, seed_bin_name, step_dir_name
from runner.checkpoint.listing import read_manifest_dir
from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import FORMAT_FILES, FORMAT_SEED_BIN
from runner.checkpoint.verify import newest_verified, verify_dir
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.errors import ConfigError, IntegrityError, NoVerifiedCheckpointError


def bin_to_run_dir(
    src: Path, run_dir: Path, *, samples_seen: int = 0, writer_id: str
) -> CommittedCheckpoint:
    """Add RUN_DIR/checkpoints/step_<header step>/ holding a copy of `src`."""
    header = read_header(src)
    target = Path(run_dir) / CHECKPOINTS_DIR / step_dir_name(header.step)
    if target.exists():
        raise ConfigError(f"{target} already exists; nothing was overwritten")
    writer = CheckpointWriter(
        Path(run_dir) / CHECKPOINTS_DIR, run_id=f"seed-{header.step}", writer_id=writer_id
    )
    return adopt_seed_bin(
        writer, src, copy=True, samples_seen=samples_seen, extra={"converted_from": src.name}
    )


def resolve_step_dir(src: Path) -> Path:
    """A checkpoint dir as given, or the newest checkpoint that verifies in a run dir."""
    if (src / MANIFEST_NAME).is_file():
        return src
    if not (src / CHECKPOINTS_DIR).is_dir():
        raise ConfigError(f"{src}: neither a checkpoint directory nor a run directory")
    from runner.storage.file import FileStorage

    manifest = newest_verified(FileStorage(src))
    if manifest is None:
        raise NoVerifiedCheckpointError(f"{src}: no checkpoint verifies; nothing to convert")
    return src / CHECKPOINTS_DIR / step_dir_name(manifest.step)


def checkpoint_to_bin(src: Path, dst: Path) -> tuple[int, int]:
    """Write the seed file of a checkpoint; returns (step, size)."""
    if dst.exists():
        raise ConfigError(f"{dst} already exists; nothing was overwritten")
    if dst.suffix != ".bin":
        raise ConfigError(f"{dst}: the seed file must end in .bin")
    step_dir = resolve_step_dir(src)
    manifest = read_manifest_dir(step_dir)
    if manifest.format == FORMAT_SEED_BIN:
        # verbatim copy of the verified file: a round trip is byte-identical
        verify_dir(step_dir, manifest=manifest)
        if len(manifest.files) != 1:
            raise IntegrityError(f"{step_dir}: a seed-bin checkpoint must hold exactly one file")
        entry = manifest.files[0]
        with open(step_dir / entry.path, "rb") as f, HashingFileWriter(dst) as out:
            for chunk in read_chunks(f):
                out.write(chunk)
            if out.digest_so_far() != entry.sha256:
                raise IntegrityError(f"{step_dir / entry.path} changed while it was copied")
            out.commit()
        read_header(dst)
        return manifest.step, out.size
    if manifest.format == FORMAT_FILES:
        raise ConfigError(
            f"{step_dir} holds a trainer's own files (format files, from "
            f"{manifest.extra.get('source', '?')}), not a train state this runner can write "
            "as a seed file; `runner pull` copies it out as it is"
        )
    state = load_state(step_dir, manifest=manifest)
    size, _ = write_seed_file(state, dst, source=str(step_dir))
    return manifest.step, size


def adopt_seed_bin(
    writer: CheckpointWriter,
    src: Path,
    *,
    copy: bool,
    samples_seen: int = 0,
    world_size: int = 1,
    extra: dict[str, Any] | None = None,
) -> CommittedCheckpoint:
    """Commit a seed .bin as checkpoint `step_<header step>` (moved in, or copied)."""
    header = read_header(src)
    size, sha256, fingerprint = hash_seed_file(src)
    meta = CheckpointMeta(
        step=header.step,
        samples_seen=samples_seen,
        world_size=world_size,
        epoch=0,
        batch_in_epoch=0,
        fingerprint=fingerprint,
        extra={"n_params": header.n_params, **(extra or {})},
    )
    return writer.adopt_files(
        {seed_bin_name(header.step): Path(src)},
        meta=meta,
        format=FORMAT_SEED_BIN,
        copy=copy,
        digests={seed_bin_name(header.step): (size, sha256)},
    )
