"""A job on several nodes, each on its own disk: the mirror is the only shared state, and the
mirror's manifest is the one commit point of a checkpoint.

Saving (`commit_to_bucket`, every rank at the same step):

    every rank  DCP save of its part into a staging dir of its own on its node's disk
                (runner.checkpoint.ranked.write_part: hashed and fsynced as written), then
                uploads those files to this save's attempt dir in the mirror,
                `checkpoints/step_N/<attempt>/`, each checked there (size; the backend's
                checksum where it has one); the ranks of all nodes upload at once
    all_gather  each rank's file entries, or what went wrong on it
    rank 0      the manifest (every rank's files, world_size) put last, create-only: the
                checkpoint exists from that instant; the outcome is broadcast
    every rank  removes its staging dir (a node keeps no copy: nothing local claims to be a
                checkpoint that only the mirror holds whole)

Resuming from the mirror alone: runner.mirror.node_resume.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from runner.checkpoint.existing import same_state
from runner.checkpoint.layout import ATTEMPT_FIELD, checkpoint_key, step_dir_name
from runner.checkpoint.manifest import FORMAT_DCP, FileEntry, Manifest
from runner.checkpoint.ranked import not_committed, write_part
from runner.checkpoint.staging import Staging
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.collective.failures import RankFailure
from runner.collective.group import Group
from runner.collective.step import Step
from runner.errors import (
    CheckpointWriteError,
    IntegrityError,
    RunnerError,
    StorageNotFoundError,
)
from runner.mirror.remote_layout import new_attempt_id, to_remote
from runner.mirror.upload import discard_attempt, put_manifest, remote_manifest, upload_file
from runner.state.ranked import RankedPayload
from runner.storage.base import Storage
from runner.storage.retry import store_deadline

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class NodeBucket:
    """What every rank of a multi-node job needs to commit in, and resume from, the mirror."""

    storage: Storage
    writer_id: str
    deadline: Callable[[], float | None] = lambda: None
    """A stop's deadline (monotonic) when one was requested: no upload waits past it."""


# -- saving -----------------------------------------------------------------------------------


def commit_to_bucket(
    writer: CheckpointWriter,
    part: RankedPayload,
    *,
    meta: CheckpointMeta,
    group: Group,
    bucket: NodeBucket,
) -> CommittedCheckpoint:
    """COLLECTIVE: commit one checkpoint of every rank's part in the mirror (module
    docstring); returns it on every rank (its `store_uri` the mirror), or raises
    CheckpointWriteError on every rank. Collective steps (runner.collective.step): rank 0's
    attempt id; every rank's staging dir, at the same step; every rank's upload; rank 0's
    manifest."""
    step = Step(group, fail=not_committed, own=(CheckpointWriteError,))
    attempt = step.decide(lambda: new_attempt_id(bucket.writer_id))
    base = f"{checkpoint_key(meta.step)}/{attempt}"
    with contextlib.ExitStack() as stack:
        stage: Staging | None = None

        def stage_dir() -> int:
            nonlocal stage
            stage = stack.enter_context(writer.staging(meta.step))
            return meta.step

        # DCP's save is collective: every rank enters it, or none does; and every rank must
        # be saving the same step (a save one rank gave up on early must not pair with the
        # others' next one)
        steps = step.gather(stage_dir, what="could not create its staging directory")
        if differ := [
            RankFailure(r, f"it is saving step {s}, rank 0 step {steps[0]}")
            for r, s in enumerate(steps)
            if s != steps[0]
        ]:
            raise not_committed(differ, group.rank)  # every rank sees the same list
        assert stage is not None
        staged = stage

        def upload() -> list[FileEntry]:
            entries = write_part(staged, part, group)
            return _upload_part(staged, entries, bucket=bucket, base=base, rank=group.rank)

        def commit(parts: list[list[FileEntry]]) -> CommittedCheckpoint:
            manifest = _commit_manifest(writer, parts, meta=meta, bucket=bucket, attempt=attempt)
            return CommittedCheckpoint(
                step=meta.step,
                path=writer.ckpt_dir / step_dir_name(meta.step),
                manifest=manifest,
                store_uri=bucket.storage.uri,
            )

        return step.run(
            upload,
            commit,
            decides="the manifest was not written",
            # no manifest names what was uploaded: it goes before any rank hears of it
            undo=lambda: _names_attempt(bucket, meta.step, attempt),
        )


def _commit_manifest(
    writer: CheckpointWriter,
    parts: list[list[FileEntry]],
    *,
    meta: CheckpointMeta,
    bucket: NodeBucket,
    attempt: str,
) -> Manifest:
    """Rank 0: the manifest of every rank's files, put last, create-only. When the put
    failed and yet its manifest landed (only the answer was lost), committed."""
    local = writer.manifest_for([entry for p in parts for entry in p], meta=meta, format=FORMAT_DCP)
    try:
        return _put_manifest(bucket, local, attempt=attempt)
    except BaseException:
        if _names_attempt(bucket, meta.step, attempt):  # if not, its objects go
            return local
        raise


def _names_attempt(bucket: NodeBucket, step: int, attempt: str) -> bool:
    """After a failure: whether the step's manifest names this attempt (the put landed).
    When that cannot be told, the attempt's objects stay (never delete what a manifest may
    name: an orphan sweep removes them a day later if none does); else they are removed."""
    storage = bucket.storage
    try:
        with store_deadline(bucket.deadline()):
            there = remote_manifest(storage, step)
            if there is not None and there.extra.get(ATTEMPT_FIELD) == attempt:
                return True
            discard_attempt(storage, base=checkpoint_key(step), attempt=attempt)
    except RunnerError as exc:
        log.warning("step %d: could not tell whether %s holds it: %s", step, storage.uri, exc)
    return False


def _upload_part(
    stage: Staging, entries: list[FileEntry], *, bucket: NodeBucket, base: str, rank: int
) -> list[FileEntry]:
    """This rank's files into the attempt dir, each checked there."""
    try:
        for entry in entries:
            # asked per file: a stop during a periodic save's upload bounds what is left of it
            with store_deadline(bucket.deadline()):
                upload_file(
                    bucket.storage,
                    key=f"{base}/{entry.path}",
                    src=stage.path / entry.path,
                    size=entry.size,
                    sha256=entry.sha256,
                )
    except (OSError, RunnerError) as exc:
        log.error("rank %d could not upload its part of the checkpoint: %s", rank, exc)
        raise CheckpointWriteError(f"upload to {bucket.storage.uri} failed: {exc}") from exc
    return entries


def _put_manifest(bucket: NodeBucket, local: Manifest, *, attempt: str) -> Manifest:
    """The manifest, create-only: the commit (runner.mirror.upload.put_manifest). A step
    taken by this very state counts only once that copy is whole and verified (same
    fingerprint, every file hashed: DCP's index differs between two saves of one state, so
    the files alone cannot tell)."""
    storage = bucket.storage
    remote = to_remote(local, attempt=attempt)
    with store_deadline(bucket.deadline()):
        check_all_there(storage, remote)
        _, ours = put_manifest(storage, local, remote, verify=True, same=same_state)
    if ours:
        log.info(
            "checkpoint step %d committed in %s (%d files from %d ranks, %.1f MB)",
            local.step,
            storage.uri,
            len(local.files),
            local.world_size,
            local.total_bytes / 1e6,
        )
    return local


def check_all_there(storage: Storage, remote: Manifest) -> None:
    """Every rank's file is in this storage at its size before the manifest names it: a
    node given another --mirror would otherwise leave a manifest of missing files."""
    base = checkpoint_key(remote.step)
    for entry in remote.files:
        try:
            size: int | None = storage.head(f"{base}/{entry.path}").size
        except StorageNotFoundError:
            size = None
        if size != entry.size:
            raise IntegrityError(
                f"{storage.uri}/{base}/{entry.path}: uploaded by its rank but "
                f"{'missing' if size is None else f'{size} bytes, not {entry.size}'} here; "
                "every node must be given the same --mirror"
            )


# -- resuming ---------------------------------------------------------------------------------
