"""A placement per way of running: one process, ranks on one node, ranks on several nodes.

Each one owns what differs between them, so that the session and its checkpointer never ask
which one they are in:

    what                  OneProcess            RanksOnOneNode          RanksOnNodes
    the stop after a step its own stop          agreed by every rank    (as on one node)
    a save's commit       writer.write_state    every rank its part,    every rank uploads its
                                                rank 0's manifest       part, rank 0's manifest
                                                (checkpoint/ranked.py)  in the mirror (nodes.py)
    the resume point      run dir ∪ mirror      rank 0's, broadcast     the mirror's newest,
                                                                        broadcast
    loading it            load_into             DCP: every rank its     each rank fetches what
                                                part                    it reads
    a full disk           make room, retry      no retry (every rank    (as on one node)
                                                would have to agree)
    after the final save  -                     barrier (rank 0's       (as on one node)
                                                upload)

`placement_for` picks one from the launch (runner.runtime.rank) and the config.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.checkpoint.layout import CHECKPOINTS_DIR, step_dir_name
from runner.checkpoint.manifest import FORMAT_DCP, Manifest
from runner.checkpoint.resume_point import ResumePoint
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.collective.group import SINGLE, Group
from runner.config import RunConfig
from runner.errors import ConfigError, IntegrityError, RunnerError, SchemaError
from runner.preemption.exiting import end_without_teardown
from runner.preemption.policy import SavePolicy
from runner.preemption.startup import run_interruptible
from runner.preemption.stop import StopController
from runner.runtime.lifecycle import stop_deadline
from runner.runtime.rank import RankContext
from runner.session.capture import TrainState, load_into
from runner.session.coordination import (
    PEER_STOP,
    agree_on_step,
    decided_on_primary,
    resolve_on_primary,
)
from runner.state.counters import Counters
from runner.state.ranked import RankedPayload

if TYPE_CHECKING:
    from runner.mirror.nodes import NodeBucket

# the session's lines keep one logger name (tests/e2e/test_readme_example.py pins it)
log = logging.getLogger("runner.session.train_session")

Point = ResumePoint[dict[str, Any]]
Read = Callable[[Path, Manifest], dict[str, Any]]


class Placement:
    """What every way of running provides; the defaults are those of one process, whose
    every decision is its own (`OneProcess`)."""

    several_ranks = False  # a commit's log line names its ranks
    makes_room = True  # a full disk: delete an older checkpoint and retry the save
    fixes_length_in_samples = False  # --steps is the run's length unless a checkpoint says
    store_uri: str | None = None  # checkpoints are committed in the run dir

    def __init__(self, stop: StopController | None = None, group: Group = SINGLE) -> None:
        """`stop`: None for a placement that only captures and commits (a bare
        Checkpointer's default); every session's placement has one."""
        self._stop = stop
        self.group = group
        self.save_group = group

    @property
    def stop(self) -> StopController:
        if self._stop is None:
            raise RuntimeError("this placement was built without a StopController")
        return self._stop

    # -- the step boundary ------------------------------------------------------------------

    def step_ended(self, *, step: int, policy: SavePolicy, grace_seconds: float) -> None:
        """After each optimizer step, before `stopping` and `save_reason` are read."""

    @property
    def stopping(self) -> bool:
        """A stop this process (or every rank) must act on now."""
        return self.stop.stop_requested

    def save_reason(self, *, step: int, policy: SavePolicy) -> str | None:
        """Why the step just taken is saved (asked for, or due), or None; read when the loop
        goes on."""
        return self.stop.take_checkpoint_request() or policy.due(step)

    def agree_startup(self, *, given_up: bool) -> bool:
        """Whether start-up was given up on (by a stop during its store work)."""
        return given_up

    def after_final(self) -> None:
        """Once the final checkpoint is committed and uploaded (or not)."""

    # -- commit -----------------------------------------------------------------------------

    def commit(
        self,
        writer: CheckpointWriter,
        payload: dict[str, Any] | RankedPayload,
        meta: CheckpointMeta,
    ) -> CommittedCheckpoint:
        assert not isinstance(payload, RankedPayload)
        return writer.write_state(payload, meta=meta)

    # -- resume -----------------------------------------------------------------------------

    def cleans_partials(self, rank: RankContext) -> bool:
        """Whether this process removes the run dir's staging debris at start."""
        return rank.acts_as_primary

    def before_resume(self, rank: RankContext, ckpt_dir: Path) -> None:
        """Anything to say about the run dir before the resume point is chosen."""

    def newest(self, read_newest: Callable[[], Point | None], read: Read) -> Point | None:
        """The checkpoint to resume from, read (not yet loaded), on this process."""
        return read_newest()

    def load(self, state: TrainState, point: Point, *, writer: CheckpointWriter) -> Counters:
        """Load `point` into the live `state` (every rank at once when there are several):
        a whole state as read, or a multi-rank (torch-dcp) one by DCP into the live tensors,
        resharded to this world size."""
        if point.manifest.format != FORMAT_DCP:
            return load_into(state, lambda _template: point.loaded)
        from runner.checkpoint.ranked import load_ranked

        return load_ranked(
            _loads_ranked(state, point.step_dir), point.step_dir, point.manifest, group=self.group
        )

    def resume(
        self,
        point: Point,
        *,
        load: Callable[[Point], Counters],
        chosen: Callable[[Point | None], None],
        read: Read,
    ) -> tuple[Point, Counters]:
        """Load `point` (`load`); the placement that can try an older one on a refusal does,
        telling `chosen` each one it moves to."""
        return point, load(point)


class OneProcess(Placement):
    """One process, its run dir on its own disk."""


class RanksOnOneNode(Placement):
    """Several ranks sharing one run dir: every decision is rank 0's or agreed by all, each
    rank writes and loads its own part (runner.checkpoint.ranked)."""

    several_ranks = True
    makes_room = False
    fixes_length_in_samples = True

    def __init__(self, stop: StopController, group: Group, save_group: Group) -> None:
        super().__init__(stop, group)
        # a background save's collectives run beside the loop's: a channel of their own
        self.save_group = save_group
        self._agreed_stop = False
        self._reason: str | None = None

    def step_ended(self, *, step: int, policy: SavePolicy, grace_seconds: float) -> None:
        decision = agree_on_step(
            self.group,
            stop=self.stop,
            policy=policy,
            step=step,
            grace_seconds=grace_seconds,
            clock=time.monotonic,
        )
        self._agreed_stop = decision.stop
        self._reason = decision.save_reason

    @property
    def stopping(self) -> bool:
        # never the local stop alone: every rank leaves the loop after the same step
        return self._agreed_stop

    def save_reason(self, *, step: int, policy: SavePolicy) -> str | None:
        return self._reason

    def agree_startup(self, *, given_up: bool) -> bool:
        """Start-up given up on one rank (rank 0's store work) is given up on all, so that
        none trains alone; a stop that came while the ranks resumed ends the run before its
        first step."""
        all_given_up, stopping = self.group.agree((int(given_up), int(self.stop.stop_requested)))
        if (all_given_up or stopping) and not self.stop.stop_requested:
            self.stop.request_stop(PEER_STOP)
        self._agreed_stop = bool(all_given_up or stopping)
        return given_up or bool(all_given_up)

    def after_final(self) -> None:
        # every rank waits for rank 0's final upload: torchrun stops the others (SIGTERM,
        # SIGKILL 30 s later) as soon as one rank exits
        self.group.barrier()

    def commit(
        self,
        writer: CheckpointWriter,
        payload: dict[str, Any] | RankedPayload,
        meta: CheckpointMeta,
    ) -> CommittedCheckpoint:
        from runner.checkpoint.ranked import write_ranked

        assert isinstance(payload, RankedPayload)
        return write_ranked(writer, payload, meta=meta, group=self.save_group)

    def newest(self, read_newest: Callable[[], Point | None], read: Read) -> Point | None:
        return resolve_on_primary(self.group, read_newest, read)


class RanksOnNodes(RanksOnOneNode):
    """Ranks on several nodes, each on its own disk: the mirror is the only shared state and
    its manifest the one commit point (runner.mirror.nodes); the run dirs hold none."""

    def __init__(
        self,
        stop: StopController,
        group: Group,
        save_group: Group,
        *,
        bucket: NodeBucket,
        ckpt_dir: Path,
        fresh_start: bool,
    ) -> None:
        super().__init__(stop, group, save_group)
        self.bucket = bucket
        self.store_uri = bucket.storage.uri
        self._ckpt_dir = ckpt_dir  # scratch room for a fetch; no checkpoint is kept there
        self._fresh_start = fresh_start

    def commit(
        self,
        writer: CheckpointWriter,
        payload: dict[str, Any] | RankedPayload,
        meta: CheckpointMeta,
    ) -> CommittedCheckpoint:
        from runner.mirror.nodes import commit_to_bucket

        assert isinstance(payload, RankedPayload)
        return commit_to_bucket(
            writer, payload, meta=meta, group=self.save_group, bucket=self.bucket
        )

    def cleans_partials(self, rank: RankContext) -> bool:
        return rank.is_local_primary  # each node cleans its own disk

    def before_resume(self, rank: RankContext, ckpt_dir: Path) -> None:
        """A checkpoint committed in this run dir (by an earlier run on one node) is not
        used: several nodes resume from the mirror alone. Say so once per node."""
        from runner.checkpoint.writer import committed_steps

        if not rank.is_local_primary:
            return
        steps = committed_steps(ckpt_dir)
        if steps:
            log.warning(
                "%s holds checkpoint(s) %s committed by a run on one node; a job on several "
                "nodes resumes from the mirror only and leaves them alone. If one is newer "
                "than the mirror's newest, `runner push %s MIRROR` first",
                ckpt_dir,
                ", ".join(map(str, steps)),
                ckpt_dir.parent,
            )

    def newest(self, read_newest: Callable[[], Point | None], read: Read) -> Point | None:
        return self._newest_in_bucket(read)

    def _newest_in_bucket(
        self, read: Read, *, refused: dict[int, BaseException] | None = None
    ) -> Point | None:
        """Rank 0 picks the mirror's newest whole checkpoint (given up on by a stop), every
        rank learns its manifest; `load` then fetches what each rank reads. A checkpoint one
        process wrote is fetched whole by every rank and read here."""
        from runner.mirror.node_resume import fetch_whole, newest_in_bucket
        from runner.mirror.remote_layout import to_local

        bucket = self.bucket
        fresh = self._fresh_start

        def find() -> Manifest | None:
            return run_interruptible(
                lambda: newest_in_bucket(bucket.storage, fresh_start=fresh, refused=refused),
                stop=self.stop,
                what=f"looking for the newest checkpoint in {bucket.storage.uri}",
            )

        remote = decided_on_primary(self.group, find)
        if remote is None:
            return None
        local = to_local(remote, source=f"{bucket.storage.uri}: step {remote.step}")
        checkpoint = CommittedCheckpoint(
            step=remote.step,
            path=self._ckpt_dir / step_dir_name(remote.step),
            manifest=local,
            store_uri=bucket.storage.uri,
        )
        loaded: dict[str, Any] = {}
        if local.format != FORMAT_DCP:  # one process wrote it: every rank reads it whole
            loaded = fetch_whole(
                bucket,
                remote.step,
                into=self._ckpt_dir,
                read=lambda step_dir: read(step_dir, local),
                group=self.group,
            )
        return ResumePoint(checkpoint=checkpoint, loaded=loaded, from_mirror=True, remote=remote)

    def load(self, state: TrainState, point: Point, *, writer: CheckpointWriter) -> Counters:
        if point.manifest.format != FORMAT_DCP or point.remote is None:
            return super().load(state, point, writer=writer)
        from runner.mirror.node_resume import load_from_bucket

        return load_from_bucket(
            _loads_ranked(state, point.step_dir),
            point.remote,
            writer=writer,
            group=self.group,
            bucket=self.bucket,
        )

    def resume(
        self,
        point: Point,
        *,
        load: Callable[[Point], Counters],
        chosen: Callable[[Point | None], None],
        read: Read,
    ) -> tuple[Point, Counters]:
        """Load `point`, or when it does not verify or load (on every rank alike:
        runner.mirror.node_resume.raise_on_all) the next older one. A store that may recover is
        not a refusal: raised (exit 1)."""
        refused: dict[int, BaseException] = {}
        current: Point | None = point
        while current is not None:
            try:
                return current, load(current)
            except (IntegrityError, SchemaError) as exc:
                if self.group.rank == 0:
                    log.warning("not resuming from step %d: %s", current.step, exc)
                refused[current.step] = exc
            current = self._newest_in_bucket(read, refused=refused)  # every rank
            chosen(current)
        # --fresh-start set every one aside, but this state was partly loaded from one
        raise RunnerError(
            "every checkpoint in the mirror was set aside (--fresh-start) after one failed "
            "to load into this process: start the job again to begin at step 0"
        )


def _loads_ranked(state: TrainState, step_dir: Path) -> Any:
    from runner.checkpoint.ranked import LoadsRanked

    if not isinstance(state, LoadsRanked):
        raise ConfigError(
            f"{step_dir} was written by several ranks (torch-dcp) and "
            f"{type(state).__name__} has no load_ranked: resume it with a ModuleTrainState"
        )
    return state


def ranks_group(rank: RankContext, config: RunConfig) -> Group:
    """The ranks' own channel for a coordinated launch of several ranks, else SINGLE."""
    if not rank.coordinated or rank.world_size == 1:
        return SINGLE
    from runner.collective.group import dedicated_group

    group = dedicated_group(timeout_s=config.collective_timeout)
    if (group.rank, group.world_size) != (rank.rank, rank.world_size):
        raise ConfigError(
            f"torch.distributed has rank {group.rank} of {group.world_size}, the launch "
            f"environment says {rank.rank} of {rank.world_size}: initialise the process group "
            "from the launcher's environment (init_process_group() under torchrun)"
        )
    # this group's gloo threads outlive the process group: a framework's trainer that ends
    # through exit_process must skip the interpreter's teardown, as the demo does, or a rank
    # that finished can abort (SIGABRT) after its exit code was decided
    end_without_teardown()
    return group


def placement_for(
    rank: RankContext, config: RunConfig, *, stop: StopController, group: Group
) -> Placement:
    """The placement of this launch: one process (or a group of one), ranks on one node,
    or ranks on several nodes (which need --mirror). Called after the ranks agreed on their
    settings, so that every rank builds the same one."""
    if group.single:
        return OneProcess(stop)
    save_group = group
    if config.save_mode == "async":
        from runner.collective.group import dedicated_group

        save_group = dedicated_group(timeout_s=config.collective_timeout)
    if not rank.multi_node:
        return RanksOnOneNode(stop, group, save_group)
    return RanksOnNodes(
        stop,
        group,
        save_group,
        bucket=_node_bucket(rank, config, stop),
        ckpt_dir=Path(config.run_dir) / CHECKPOINTS_DIR,
        fresh_start=config.fresh_start,
    )


def _node_bucket(rank: RankContext, config: RunConfig, stop: StopController) -> NodeBucket:
    """Every rank's handle on the mirror for a job on several nodes (each rank uploads and
    fetches its own files); --mirror is required there."""
    from runner.mirror.nodes import NodeBucket
    from runner.storage import open_storage

    # the ranks agreed on --mirror at start: all of them refuse alike when it is none
    if config.mirror is None:
        raise ConfigError(
            f"this job runs on several nodes ({rank.world_size} ranks, "
            f"{rank.local_world_size} on this one) and has no --mirror: with each "
            "node on its own disk the mirror is the only place a checkpoint of every "
            "rank can be committed. Give every node the same --mirror (s3://bucket/run)"
        )
    storage = open_storage(config.mirror, store_timeout_s=config.store_timeout, give_up_once=False)
    grace = config.grace_seconds
    return NodeBucket(
        storage=storage,
        writer_id=config.writer_id,
        deadline=lambda: stop_deadline(stop, grace_seconds=grace),
    )
