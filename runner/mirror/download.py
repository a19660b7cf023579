"""Download one checkpoint from a mirror into a run dir: concurrent, verified, atomic."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NoReturn

from runner.checkpoint.counter_check import check_payload_counters
from runner.checkpoint.existing import SAME, UNREADABLE, Found, LocalStep, judge, same_payload
from runner.checkpoint.layout import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    checkpoint_key,
    step_dir_name,
)
from runner.checkpoint.listing import read_manifest
from runner.checkpoint.manifest import FileEntry, Manifest
from runner.checkpoint.target import LocalTarget
from runner.checkpoint.verify import verify_dir
from runner.errors import CheckpointConflictError
from runner.mirror.remote_layout import for_each_file, to_local
from runner.preemption.startup import publishing
from runner.storage.base import ProgressCallback, Storage

log = logging.getLogger(__name__)

FILE_WORKERS = 4


def download_checkpoint(
    storage: Storage,
    step: int,
    run_dir: Path,
    *,
    progress: ProgressCallback | None = None,
    file_workers: int = FILE_WORKERS,
) -> Path:
    """Fetch checkpoint `step` into `run_dir/checkpoints/step_N` and return that directory.

    Files land in a temp directory beside the final one, each checked against the manifest's
    size and sha256; the manifest (the writer's original, attempt dir stripped) is written
    last and the directory renamed into place. IntegrityError when a file does not verify:
    nothing is left under the final name, and likewise when the payload's counters disagree
    with the manifest. A `file://` source never follows a symlink (FileStorage refuses)."""
    remote = read_manifest(storage, step)
    local = to_local(remote, source=f"{storage.uri}/{checkpoint_key(step)}/{MANIFEST_NAME}")
    ckpt_dir = Path(run_dir) / CHECKPOINTS_DIR
    final = ckpt_dir / step_dir_name(step)
    if final.is_dir() and _holds(final, local):
        return final
    # the writer's target: its temp names, so its cleanup removes a crashed pull's leftovers
    target = LocalTarget(ckpt_dir)
    with target.staging(step) as stage:
        _fetch_files(
            storage, remote, local, stage.path, progress=progress, file_workers=file_workers
        )
        # the same rules as every other check (runner.checkpoint.verify): the files were
        # hashed as they arrived; the payload's counters must agree with the manifest too,
        # or a mislabelled checkpoint would be published and only refused when loaded
        check_payload_counters(stage.path, local)
        # the manifest in the schema it was read as, the lowest that expresses it (a v2
        # torch-sharded one is written back as v2 torch-sharded): the bytes its writer
        # committed; never published once a stop has given start-up up
        target.finalize(stage, replace_only_corrupt(local), gate=publishing)
    log.info("downloaded checkpoint step %d from %s to %s", step, storage.uri, final)
    return final


def _fetch_files(
    storage: Storage,
    remote: Manifest,
    local: Manifest,
    staging: Path,
    *,
    progress: ProgressCallback | None,
    file_workers: int,
) -> None:
    """Every file of `remote` into `staging` under its local name, several at once, each
    hashed against the manifest as it arrives."""

    def fetch(entry: FileEntry, key: str) -> None:
        _download_one(storage, key=key, dst=staging / entry.path, entry=entry, progress=progress)

    for_each_file(local, remote, fetch, file_workers=file_workers, name="download")


def _download_one(
    storage: Storage, *, key: str, dst: Path, entry: FileEntry, progress: ProgressCallback | None
) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    # size and sha256 are checked in-stream, before the file gets its final name
    storage.get_file(key, dst, progress=progress, sha256=entry.sha256, size=entry.size)


def _holds(step_dir: Path, manifest: Manifest) -> bool:
    found = judge(lambda: verify_dir(step_dir), manifest, same=same_payload)
    return found.kind == SAME


def replace_only_corrupt(
    incoming: Manifest, *, refused: tuple[Path, str] | None = None
) -> LocalStep:
    """The existing-step policy (runner.checkpoint.existing) worded for a downloaded copy:
    a corrupt copy there is set aside (RUN_DIR/aside/), never deleted; the same checkpoint
    is kept; one that verifies, or of a schema this runner cannot read, stays
    (CheckpointConflictError). `refused`: as for `LocalStep`."""
    return LocalStep(incoming, refuse=_refuse_download, same=same_payload, refused=refused)


def _refuse_download(final: Path, found: Found) -> NoReturn:
    if found.kind == UNREADABLE:
        raise CheckpointConflictError(
            f"{final} holds a checkpoint this runner cannot read ({found.error}); not replacing "
            "it with the downloaded copy"
        ) from found.error
    raise CheckpointConflictError(
        f"{final} already holds a different checkpoint that verifies; not replacing "
        "it with the downloaded copy"
    )
