"""Resuming a job on several nodes from the mirror alone (the commit is runner.mirror.nodes).

Rank 0 picks the newest checkpoint in the mirror whose files are all there at their sizes
(`newest_in_bucket`) and broadcasts its manifest; each rank then fetches into a scratch dir of
its own only the files it reads (`load_from_bucket`), each verified against the manifest as it
arrives (sha256, size): DCP's index, the shared train state, its own rank file, and the data
files its load plan names (DCP reshards: M ranks read what N wrote). A checkpoint one process
wrote is fetched whole by every rank (`fetch_whole`). A failure on any rank is raised on all
(`raise_on_all`).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from runner.atomicity.temp import temp_name
from runner.checkpoint.aside import CORRUPT, FOREIGN, decommit_remote
from runner.checkpoint.counter_check import check_payload_counters
from runner.checkpoint.formats.dcp import DCP_METADATA, TRAIN_STATE_FILE, rank_file_name
from runner.checkpoint.layout import checkpoint_key, manifest_key, step_dir_name
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.newest import steps_newest_first
from runner.checkpoint.ranked import LoadsRanked, load_ranked
from runner.checkpoint.verify import check_remote_sizes
from runner.checkpoint.writer import CheckpointWriter
from runner.collective.failures import RankFailure, describe
from runner.collective.group import Group
from runner.collective.step import Step, kind_of
from runner.errors import (
    IntegrityError,
    PayloadNotLoadableError,
    RunnerError,
    SchemaError,
    StorageTransientError,
    UnusableCheckpointsError,
)
from runner.mirror.download import download_checkpoint
from runner.mirror.nodes import NodeBucket
from runner.mirror.remote_layout import to_local
from runner.state.counters import Counters
from runner.storage.base import Storage
from runner.storage.retry import store_deadline

log = logging.getLogger(__name__)

T = TypeVar("T")


def newest_in_bucket(
    storage: Storage,
    *,
    fresh_start: bool = False,
    refused: Mapping[int, BaseException] | None = None,
) -> Manifest | None:
    """The mirror's newest checkpoint (by progress) that is whole by the cheap check
    (manifest, every file at its size; the bytes are hashed as each rank fetches them), or
    None when it holds none.
    A step that fails the check, or is in `refused` (it failed to load moments ago), is
    skipped with a warning, never touched. When checkpoints exist and none can be used:
    UnusableCheckpointsError (exit 3), as for one node (runner.mirror.resume), unless
    `fresh_start`: then they are de-committed (manifests kept aside: a checkpoint this
    runner cannot read, or that verifies and does not load, as another version's) and the
    run starts at step 0."""
    unusable = dict(refused or {})
    for step in steps_newest_first(storage):  # by progress (runner.checkpoint.newest)
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
    """COLLECTIVE (a gather step, runner.collective.step): when any rank failed to fetch or
    load (`error`: this rank's, or None), raise on every rank the same type:
    StorageTransientError when any failure is worth retrying (exit 1), IntegrityError when a
    file did not verify, else PayloadNotLoadableError (it verified and does not load into
    this state). Names the bucket's key (`where`), not the scratch dir."""

    def mine() -> RankFailure | None:
        if error is None:
            return None
        text = str(error) if scratch is None else str(error).replace(str(scratch), where)
        return RankFailure(group.rank, text, kind_of(error))

    def fail(failures: list[RankFailure], rank: int) -> RunnerError:
        what = f"{where} could not be loaded: {describe(failures)}"
        kinds = {f.kind for f in failures}
        if "transient" in kinds:
            return StorageTransientError(f"{what}. The store may recover: exiting 1 to retry")
        if "integrity" in kinds:
            return IntegrityError(what)
        return PayloadNotLoadableError(what)

    Step(group, fail=fail).gather(mine)


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
