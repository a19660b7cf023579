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

Resuming (`resolve_in_bucket` then `load_from_bucket`): rank 0 picks the newest checkpoint
in the mirror whose files are all there at their sizes and broadcasts its manifest; each
rank fetches into a scratch dir of its own only the files it reads, each verified against
the manifest as it arrives (sha256, size): DCP's index, the shared train state, its own rank
file, and the data files its load plan names (DCP reshards: M ranks read what N wrote).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from runner.atomicity.temp import temp_name
from runner.checkpoint.aside import CORRUPT, FOREIGN, decommit_remote
from runner.checkpoint.counter_check import check_payload_counters
from runner.checkpoint.existing import same_state
from runner.checkpoint.formats.dcp import DCP_METADATA, TRAIN_STATE_FILE, rank_file_name
from runner.checkpoint.layout import ATTEMPT_FIELD, checkpoint_key, manifest_key, step_dir_name
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.manifest import FORMAT_DCP, FileEntry, Manifest
from runner.checkpoint.ranked import Failed, LoadsRanked, load_ranked, not_committed, write_part
from runner.checkpoint.staging import Staging
from runner.checkpoint.verify import check_remote_sizes
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.collective.group import Group
from runner.errors import (
    CheckpointWriteError,
    IntegrityError,
    PayloadNotLoadableError,
    RunnerError,
    SchemaError,
    StorageNotFoundError,
    StorageTransientError,
    UnusableCheckpointsError,
)
from runner.mirror.download import download_checkpoint
from runner.mirror.remote_layout import new_attempt_id, to_local, to_remote
from runner.mirror.upload import discard_attempt, put_manifest, remote_manifest, upload_file
from runner.state.counters import Counters
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
    docstring); returns it on every rank (its `store_uri` the mirror), or raises on every rank."""
    attempt = new_attempt_id(bucket.writer_id) if group.rank == 0 else ""
    attempt = group.broadcast(attempt)
    base = f"{checkpoint_key(meta.step)}/{attempt}"
    with contextlib.ExitStack() as stack:
        try:
            stage: Staging | Failed = stack.enter_context(writer.staging(meta.step))
        except (OSError, RunnerError) as exc:
            stage = Failed(group.rank, f"could not create its staging directory: {exc}")
        # DCP's save is collective: every rank enters it, or none does; and every rank must
        # be saving the same step (a save one rank gave up on early must not pair with the
        # others' next one)
        staged = group.all_gather((meta.step, stage))
        steps = {step for step, _ in staged}
        failed = [p for _, p in staged if isinstance(p, Failed)]
        if len(steps) > 1:
            failed.append(Failed(group.rank, f"the ranks are saving different steps {steps}"))
        parts: list[Any] = failed
        if not failed:
            assert isinstance(stage, Staging)
            outcome = write_part(stage, part, group)
            if not isinstance(outcome, Failed):
                outcome = _upload_part(stage, outcome, bucket=bucket, base=base, rank=group.rank)
            parts = group.all_gather(outcome)
    failed = [p for p in parts if isinstance(p, Failed)]
    if group.rank != 0:
        result = group.broadcast(None)
        if isinstance(result, list):
            raise not_committed(result, rank=group.rank)
        assert isinstance(result, CommittedCheckpoint)
        return result
    try:
        if failed:
            raise not_committed(failed, rank=0)
        files = [entry for p in parts for entry in p]
        local = writer.manifest_for(files, meta=meta, format=FORMAT_DCP)
        manifest = _put_manifest(bucket, local, attempt=attempt)
    except BaseException as exc:
        landed = _names_attempt(bucket, meta.step, attempt)  # if not, its objects go
        if landed and not failed:
            manifest = local  # the manifest landed, only its answer was lost: committed
        else:
            told = failed or [Failed(0, f"the manifest was not written: {exc}")]
            group.broadcast(told)
            if not isinstance(exc, Exception) or isinstance(exc, CheckpointWriteError):
                raise
            # the same error on every rank: training goes on after it, or stops, on all
            raise not_committed(told, rank=0) from exc
    committed = CommittedCheckpoint(
        step=meta.step,
        path=writer.ckpt_dir / step_dir_name(meta.step),
        manifest=manifest,
        store_uri=bucket.storage.uri,
    )
    group.broadcast(committed)
    return committed


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
) -> list[FileEntry] | Failed:
    """This rank's files into the attempt dir, each checked there; what failed otherwise."""
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
        return Failed(rank, f"upload to {bucket.storage.uri} failed: {exc}")
    return entries


def _put_manifest(bucket: NodeBucket, local: Manifest, *, attempt: str) -> Manifest:
    """The manifest, create-only: the commit (runner.mirror.upload.put_manifest). A step
    taken by this very state counts only once that copy is whole and verified (same
    fingerprint, every file hashed: DCP's index differs between two saves of one state, so
    the files alone cannot tell)."""
    storage = bucket.storage
    remote = to_remote(local, attempt=attempt)
    with store_deadline(bucket.deadline()):
        _check_all_there(storage, remote)
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


def _check_all_there(storage: Storage, remote: Manifest) -> None:
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


def newest_in_bucket(
    storage: Storage,
    *,
    fresh_start: bool = False,
    refused: Mapping[int, BaseException] | None = None,
) -> Manifest | None:
    """The mirror's newest checkpoint that is whole by the cheap check (manifest, every file
    at its size; the bytes are hashed as each rank fetches them), or None when it holds none.
    A step that fails the check, or is in `refused` (it failed to load moments ago), is
    skipped with a warning, never touched. When checkpoints exist and none can be used:
    UnusableCheckpointsError (exit 3), as for one node (runner.mirror.resume), unless
    `fresh_start`: then they are de-committed (manifests kept aside: a checkpoint this
    runner cannot read, or that verifies and does not load, as another version's) and the
    run starts at step 0."""
    unusable = dict(refused or {})
    for step in reversed(list_checkpoints(storage)):
        if step in unusable:
            continue
        try:
            manifest = check_remote_sizes(storage, step)
            to_local(manifest, source=f"{storage.uri}/{manifest_key(step)}")
            return manifest
        except (SchemaError, IntegrityError) as exc:
            log.warning("not resuming from step %d in %s: %s", step, storage.uri, exc)
            unusable[step] = exc
    if unusable and not fresh_start:
        listed = "; ".join(f"step {step}: {why}" for step, why in sorted(unusable.items()))
        raise UnusableCheckpointsError(
            f"{storage.uri} holds checkpoints and none of them can be used ({listed}). Nothing "
            "was trained or written. Restore the missing objects, or pass --fresh-start to "
            "set them aside (never deleted) and start at step 0"
        )
    for step, why in unusable.items():
        foreign = isinstance(why, SchemaError)  # includes "verifies, does not load"
        decommit_remote(storage, step, reason=FOREIGN if foreign else CORRUPT)
    if unusable:
        log.warning("--fresh-start: %d unusable checkpoint(s) set aside", len(unusable))
    return None


def fetch_whole(
    bucket: NodeBucket, step: int, *, into: Path, read: Callable[[Path], T], group: Group
) -> T:
    """COLLECTIVE: a checkpoint one process wrote (a whole state, not DCP parts): every rank
    fetches all of it into a scratch run dir of its own, verified, within a stop's deadline,
    and `read`s it; the scratch is gone on return. A failure on any rank is raised on all
    (`raise_on_all`)."""
    scratch = into / temp_name(f"fetch-{step_dir_name(step)}")
    error: BaseException | None = None
    try:
        with store_deadline(bucket.deadline()):
            try:
                loaded = read(download_checkpoint(bucket.storage, step, scratch))
            except (OSError, RunnerError) as exc:
                error = exc
        where = f"{bucket.storage.uri}/{checkpoint_key(step)}"
        raise_on_all(group, error, where=where, scratch=scratch)
        return loaded
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_from_bucket(
    state: LoadsRanked,
    remote: Manifest,
    *,
    writer: CheckpointWriter,
    group: Group,
    bucket: NodeBucket,
    restore_rng: bool = True,
) -> Counters:
    """COLLECTIVE: load the mirror's checkpoint `remote` (its manifest as stored) into
    `state` on every rank, each fetching only the files it reads (module docstring), within
    a stop's deadline. Raised on every rank alike: StorageTransientError when a fetch failed
    for a reason worth retrying (exit 1), IntegrityError when a file does not verify, else
    what the load raised (the caller may then try an older checkpoint)."""
    where = f"{bucket.storage.uri}/{checkpoint_key(remote.step)}"
    local = to_local(remote, source=f"{where}/manifest.json")
    scratch = writer.ckpt_dir / temp_name(f"fetch-{step_dir_name(remote.step)}")
    fetcher = _Fetcher(bucket.storage, remote, local, scratch)
    listed = {entry.path for entry in local.files}
    own = rank_file_name(group.rank)
    first = [DCP_METADATA, TRAIN_STATE_FILE, own if own in listed else rank_file_name(0)]
    try:
        with store_deadline(bucket.deadline()):
            try:
                fetcher.fetch(first)
                check_payload_counters(scratch, local)
            except (OSError, RunnerError) as exc:
                fetcher.error = exc
            # DCP's load is collective: every rank enters it, or none does
            raise_on_all(group, fetcher.error, where=where, scratch=scratch)
            counters: Counters | None = None
            try:
                counters = load_ranked(
                    state,
                    scratch,
                    local,
                    group=group,
                    restore_rng=restore_rng,
                    dcp_reader=_fetching_reader(scratch, fetcher),
                )
            except (OSError, RunnerError) as exc:
                fetcher.error = fetcher.error or exc
            # a failure on one rank alone (its rank file) is told to the others too
            raise_on_all(group, fetcher.error, where=where, scratch=scratch)
        assert counters is not None
        return counters
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        log.info(
            "rank %d fetched %d of the %d files of step %d from %s (%.1f MB)",
            group.rank,
            len(fetcher.fetched),
            len(local.files),
            remote.step,
            bucket.storage.uri,
            fetcher.fetched_bytes / 1e6,
        )


def raise_on_all(
    group: Group, error: BaseException | None, *, where: str, scratch: Path | None = None
) -> None:
    """COLLECTIVE: when any rank failed to fetch or load (`error`: this rank's, or None),
    raise on every rank the same type: StorageTransientError when any failure is worth
    retrying (exit 1), IntegrityError when a file did not verify, else
    PayloadNotLoadableError (it verified and does not load into this state). Names the
    bucket's key (`where`), not the scratch dir."""
    mine = None
    if error is not None:
        kind = (
            "transient"
            if isinstance(error, StorageTransientError)
            else "integrity"
            if isinstance(error, IntegrityError)
            else "other"
        )
        text = str(error) if scratch is None else str(error).replace(str(scratch), where)
        mine = (group.rank, kind, text)
    failures = [f for f in group.all_gather(mine) if f is not None]
    if not failures:
        return
    what = f"{where} could not be loaded: " + "; ".join(f"rank {r}: {m}" for r, _, m in failures)
    kinds = {kind for _, kind, _ in failures}
    if "transient" in kinds:
        raise StorageTransientError(f"{what}. The store may recover: exiting 1 to retry")
    if "integrity" in kinds:
        raise IntegrityError(what)
    raise PayloadNotLoadableError(what) from error


class _Fetcher:
    """Fetches files of one checkpoint into `scratch`, each hashed against the manifest."""

    def __init__(self, storage: Storage, remote: Manifest, local: Manifest, scratch: Path) -> None:
        self.storage = storage
        self.scratch = scratch
        base = checkpoint_key(remote.step)
        self._keys = {
            mine.path: (f"{base}/{theirs.path}", mine)
            for mine, theirs in zip(local.files, remote.files, strict=True)
        }
        self.fetched: list[str] = []
        self.fetched_bytes = 0
        self.error: BaseException | None = None  # this rank's first failure, if any

    def fetch(self, names: Iterable[str]) -> None:
        self.scratch.mkdir(parents=True, exist_ok=True)
        for name in sorted(set(names)):
            if name in self.fetched:
                continue
            if name not in self._keys:
                raise IntegrityError(f"{self.storage.uri}: the manifest does not list {name}")
            key, entry = self._keys[name]
            dst = self.scratch / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.storage.get_file(key, dst, sha256=entry.sha256, size=entry.size)
            self.fetched.append(name)
            self.fetched_bytes += entry.size


def _fetching_reader(scratch: Path, fetcher: _Fetcher) -> Any:
    """DCP's file reader over `scratch` that first fetches the data files this rank's load
    plan reads (built on first use: importing this module imports no torch.distributed)."""
    from torch.distributed.checkpoint import FileSystemReader

    class FetchingReader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            needed = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            try:
                fetcher.fetch(needed)
            except (OSError, RunnerError) as exc:
                fetcher.error = exc  # DCP reports it wrapped; its type decides the exit code
                raise
            return super().read_data(plan, planner)

    return FetchingReader(scratch)
