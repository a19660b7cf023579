"""The multi-rank commit protocol: every rank writes its part, global rank 0 commits them all.

    rank 0      creates checkpoints/.tmp-step_NNNNNN-<pid>-<uuid>/ and broadcasts its name
    every rank  DCP save of the tensors into it (runner.checkpoint.formats.dcp: each rank
                hashes and fsyncs its own files as it writes them), then its own
                rank_RRRRR.pt (RNG, sampler); rank 0 also train_state.pt (the shared part)
    all_gather  each rank's file entries, or what went wrong on it
    rank 0      manifest (every rank's files, world_size) written last, fsynced, renamed
                into place: the one commit point; the outcome is broadcast
    every rank  returns the committed checkpoint, or raises: nothing partial is visible

Every rank takes part in every collective whatever failed locally, so a failure on one rank
is reported on all of them instead of leaving the others waiting; a rank that dies leaves
the others' collectives failing (PeerLostError) and the staging dir to `cleanup_partial`.
The ranks of one node share its run dir. Several nodes, each on its own disk, commit in the
mirror instead (runner.mirror.nodes), with the same parts and failure reports.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from runner.checkpoint.formats.dcp import TRAIN_STATE_FILE, load_dcp, rank_file_name, save_dcp
from runner.checkpoint.manifest import FORMAT_DCP, FileEntry, Manifest
from runner.checkpoint.safe_load import torch_load
from runner.checkpoint.staging import Staging
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.collective.failures import RankFailure, describe
from runner.collective.group import Group
from runner.collective.step import RanksFailed, Step
from runner.errors import CheckpointWriteError, IntegrityError, RunnerError
from runner.state.counters import Counters
from runner.state.ranked import RankedPayload

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)


@runtime_checkable
class LoadsRanked(Protocol):
    """A TrainState that loads a multi-rank checkpoint (ModuleTrainState does)."""

    def load_ranked(
        self,
        read_tensors: Callable[[dict[str, Any]], None],
        *,
        shared: dict[str, Any],
        own: dict[str, Any],
        restore_rng: bool = True,
    ) -> Counters: ...


def write_ranked(
    writer: CheckpointWriter, part: RankedPayload, *, meta: CheckpointMeta, group: Group
) -> CommittedCheckpoint:
    """Commit one checkpoint of every rank's part; called by every rank at the same step.
    Two collective steps (runner.collective.step): rank 0's staging dir, then every rank's
    part and rank 0's commit. Rank 0's own failure is raised there as it is (a full disk
    stays a full disk); every other rank raises CheckpointWriteError naming it."""
    step = Step(group, fail=not_committed, own=(OSError, RunnerError))
    staged: Staging | None = None  # rank 0's, whose file list becomes the manifest
    with contextlib.ExitStack() as cleanup:

        def stage_dir() -> str:
            nonlocal staged
            staged = cleanup.enter_context(writer.staging(meta.step))
            return staged.path.name

        name = step.decide(stage_dir, what="could not create the staging directory")
        stage = staged or Staging(writer.ckpt_dir / name)

        def commit(parts: list[list[FileEntry]]) -> CommittedCheckpoint:
            assert staged is not None
            # the manifest names only files rank 0 sees at the size their rank wrote
            unseen = [f for r, p in enumerate(parts) if (f := _not_there(stage.path, r, p))]
            if unseen:
                raise RanksFailed(unseen)
            staged.files = [entry for p in parts for entry in p]
            return writer.commit(staged, meta=meta, format=FORMAT_DCP)

        return step.run(lambda: write_part(stage, part, group), commit, decides="the commit failed")


def write_part(stage: Staging, part: RankedPayload, group: Group) -> list[FileEntry]:
    """COLLECTIVE (DCP's save): this rank's files in `stage` (rank 0's include DCP's index
    and the shared train state). The local work of a collective step: what it raises is told
    to every rank."""
    try:
        entries = save_dcp(stage.path, part.tensors, process_group=group.process_group)
        own = Staging(stage.path)  # this rank's own list; the stage's is rank 0's manifest
        entries.append(own.write_torch(rank_file_name(part.rank), part.own))
        if part.rank == 0:
            entries.append(own.write_torch(TRAIN_STATE_FILE, part.shared))
    except (OSError, RunnerError, RuntimeError) as exc:
        log.error("rank %d could not write its part of the checkpoint: %s", part.rank, exc)
        raise
    return entries


def _not_there(stage: Path, rank: int, entries: list[FileEntry]) -> RankFailure | None:
    """What of `rank`'s reported files rank 0 does not see in `stage` at their size (a rank
    given another run dir wrote them there), or None."""
    lost = []
    for entry in entries:
        try:
            size: int | None = (stage / entry.path).stat().st_size
        except FileNotFoundError:
            size = None
        if size != entry.size:
            lost.append(
                f"{entry.path} {'missing' if size is None else f'{size} bytes, not {entry.size}'}"
            )
    if not lost:
        return None
    return RankFailure(
        rank,
        f"its files are not in rank 0's staging directory {stage} as written: "
        f"{', '.join(lost)}; the ranks of one node must share one --run-dir on one file system",
    )


def not_committed(failed: list[RankFailure], rank: int) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"the checkpoint was not committed: {describe(failed, rank=rank)}. Nothing partial "
        "is visible; the previous checkpoint is intact"
    )


def load_ranked(
    state: LoadsRanked,
    step_dir: Path,
    manifest: Manifest,
    *,
    group: Group,
    restore_rng: bool = True,
    dcp_reader: Any = None,
) -> Counters:
    """Load a torch-dcp checkpoint that was verified against `manifest` into `state`, on
    every rank at once (DCP reshards the tensors to this world size). A rank of a number the
    checkpoint has no file for (the world grew) takes rank 0's sampler position, which is
    counted in samples and the same for every rank, and keeps its RNG as seeded.
    `dcp_reader`: DCP's storage reader for the tensors (default: the files in `step_dir`;
    runner.mirror.nodes passes one that fetches the files this rank's plan reads)."""
    source = str(step_dir)
    listed = {entry.path for entry in manifest.files}
    for needed in (TRAIN_STATE_FILE, rank_file_name(0)):
        if needed not in listed:
            raise IntegrityError(f"{source}: the manifest does not list {needed}")
    shared = _load_dict(step_dir / TRAIN_STATE_FILE, source=source)
    own_name = rank_file_name(group.rank)
    if own_name in listed:
        own = _load_dict(step_dir / own_name, source=source)
    else:
        own = {**_load_dict(step_dir / rank_file_name(0), source=source), "rng": None}
        log.warning(
            "rank %d: the checkpoint was written by %d ranks and has no RNG state of this "
            "rank; its RNG stays as seeded (the data position is exact)",
            group.rank,
            manifest.world_size,
        )
    return state.load_ranked(
        lambda template: load_dcp(
            step_dir, template, process_group=group.process_group, storage_reader=dcp_reader
        ),
        shared=shared,
        own=own,
        restore_rng=restore_rng,
    )


def _load_dict(path: Path, *, source: str) -> dict[str, Any]:
    loaded = torch_load(path, source=source, mmap=False)
    if not isinstance(loaded, dict):
        raise IntegrityError(f"{path}: holds a {type(loaded).__name__}, expected a dict")
    return loaded
