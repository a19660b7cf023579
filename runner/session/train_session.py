"""The in-process API: one object that restores on start, saves by policy, stops on request.

    state = ModuleTrainState(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    with TrainSession(config, state=state, stop=stop) as session:   # restores if it can
        while not session.should_stop:
            ...one optimizer step...
            state.advance(loss=loss.item())
            session.step_done()                                     # saves when due
    sys.exit(session.exit_code)                                     # 0 finished, 75 stopped

Signal handlers are not installed here: the entry point installs them and hands over the
StopController. All work (saving, uploading) happens inside `step_done` and `finish`, at step
boundaries of the caller's loop.

Its parts live beside it: what differs between one process, ranks on one node and ranks on
several nodes in session/placement.py, saving in checkpointer.py and saves.py, a resume's
resolver and mirror wiring in resume.py, what the end says in reporting.py.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from runner.checkpoint.layout import CHECKPOINTS_DIR
from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.resume_point import ResumePoint
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.collective.group import Group
from runner.config import RunConfig
from runner.errors import EXIT_FAILURE, CheckpointWriteError, RunnerError
from runner.metrics.registry import RunnerMetrics
from runner.preemption.policy import SavePolicy
from runner.preemption.startup import StartupInterrupted
from runner.preemption.stop import StopController
from runner.runtime.lifecycle import end_run, stop_deadline
from runner.runtime.rank import SINGLE_PROCESS, RankContext
from runner.runtime.services import Services, lock_and_serve
from runner.session.attempts import SessionAttempt
from runner.session.checkpointer import PendingSave, TrainState
from runner.session.coordination import agree_on_settings
from runner.session.length import carried_length, fixed_length, steps_of
from runner.session.placement import placement_for, ranks_group
from runner.session.rebase import rebase
from runner.session.reporting import (
    durable_where,
    report_left_by_exit,
    report_not_mirrored,
    report_startup_given_up,
    report_stop,
)
from runner.session.resume import (
    keep_mirrored,
    read_newest,
    report_from_scratch,
    report_resumed,
)
from runner.session.saves import Saves
from runner.state.train_state import Counters

if TYPE_CHECKING:
    from runner.mirror import Mirror

log = logging.getLogger(__name__)


__all__ = ["TrainSession", "TrainState"]  # TrainState lives with the checkpointer


class TrainSession:
    """Restore, periodic and on-demand saves, the final checkpoint, and the exit code."""

    def __init__(
        self,
        config: RunConfig,
        *,
        state: TrainState,
        stop: StopController | None = None,
        services: Services | None = None,
        refusals_reported: bool = False,
        rank: RankContext = SINGLE_PROCESS,
        group: Group | None = None,
        job_settings: Mapping[str, object] | None = None,
    ) -> None:
        """Wires the session's parts in the order they must exist (lock, services, writer,
        checkpointer, policy, loss log), hence its length.
        `services` (metrics, mirror) default to those the config asks for, started here:
        metrics served on `config.metrics_port`, notices polled, checkpoints mirrored.
        `rank`: this process's place in a launch (the entry point reads it from torchrun's
        variables); only a process that `acts_as_primary` runs services, writes the loss log,
        prunes and keeps the seconds cadence.
        `refusals_reported`: a supervisor (`runner run`) already resolved this run dir and
        logged each checkpoint it refused; they are then logged at debug level only.
        `group`: the ranks' channel; by default a dedicated gloo group when `rank` is
        coordinated over several ranks (torch.distributed initialised by the caller: every
        rank constructs its session at the same point), else none (SINGLE).
        `job_settings`: the caller's own settings that must be equal on every rank (option
        name -> value, e.g. the demo's --batch-size), compared at start with the run's
        (runner.session.coordination.agree_on_settings): any difference is exit 2."""
        self.config = config
        self.rank = rank
        self._refusals_reported = refusals_reported
        self.state = state
        self.stop = stop or StopController()
        self._owned = contextlib.ExitStack()
        # one writer per run dir, taken before the services start and anything is written;
        # released in close(), last (runner.runtime.runlock)
        self.run_lock, services = lock_and_serve(self._owned, config, self.stop, rank, services)
        self.group = group if group is not None else ranks_group(rank, config)
        # before any other collective (the save group's exists only in async mode) and any
        # checkpoint: ranks given different settings all refuse to start
        try:
            agree_on_settings(self.group, config, node=rank.node_rank, job_settings=job_settings)
            # what differs between one process, ranks on one node and ranks on several
            self.placement = placement_for(rank, config, stop=self.stop, group=self.group)
        except BaseException:
            self._owned.close()  # no session to close: the run dir lock and services
            raise
        self.metrics: RunnerMetrics | None = services.metrics
        self.mirror: Mirror | None = services.mirror
        self.run_dir = Path(config.run_dir)
        self.ckpt_dir = self.run_dir / CHECKPOINTS_DIR
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        # A new run gets a new identity; a resumed one takes it from its checkpoint.
        self.writer = CheckpointWriter(
            self.ckpt_dir, run_id=uuid.uuid4().hex[:16], writer_id=config.writer_id
        )
        self.policy = self._policy(start_step=0)
        # this process's attempt record (runner.goodput): restore, checkpoints, stop, end
        self.attempt = SessionAttempt(config, rank=rank, metrics=self.metrics, mirror=self.mirror)
        self.saves = Saves(
            config,
            rank=rank,
            placement=self.placement,
            metrics=self.metrics,
            mirror=self.mirror,
            attempt=self.attempt,
        )
        # a full disk never stops training for the loss history: counted, logged, retried
        self.loss_log = LossLog(
            self.run_dir,
            attempt=config.writer_id,
            on_failure=self.saves.loss_log_failed,
            writes=rank.acts_as_primary,  # loss.jsonl has one writer: the primary
        )
        # the loss history is at least as durable as the checkpoint (never raises)
        self.checkpointer = self.saves.checkpointer(self.writer, before_capture=self.loss_log.sync)
        self.resumed_checkpoint: CommittedCheckpoint | None = None
        self.exit_code: int | None = None
        self.final_save_seconds: float | None = None
        self.final_upload_landed: bool | None = None
        # a stop gave up on start-up's store work: finish() then leaves the store alone
        self.startup_given_up = False
        # the run's length in samples, when it is fixed by them (runner.session.coordination)
        self.target_samples: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> TrainSession:
        try:
            self.restore()
        except BaseException:
            # no `with` body, so no __exit__: release the run dir lock and the services here
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None and self.exit_code is None:
                self.finish()
        finally:
            self.close()  # a background save in flight (started at a step boundary) ends here
        stopping = self.stop.stop_requested or self.placement.stopping
        left = isinstance(exc, SystemExit) and exc.code in (None, 0) and self.exit_code is None
        if left and stopping:
            # e.g. Lightning's SIGTERMException: exit 0 would say the job is done (reporting)
            self.exit_code = EXIT_FAILURE
            last = self.last_checkpoint or self.resumed_checkpoint
            report_left_by_exit(
                last, reason=self.stop.reason, step=self.step, ckpt_dir=self.ckpt_dir
            )
            raise SystemExit(EXIT_FAILURE) from exc

    def close(self) -> None:
        # the saver first (a background one finishes its save in flight), then the loss log,
        # then services and the run-dir lock, which the save may still need
        try:
            self.checkpointer.close()
        finally:
            self.loss_log.close()
            self._owned.close()

    @property
    def last_checkpoint(self) -> CommittedCheckpoint | None:
        """The newest checkpoint this process committed (None before its first)."""
        return self.saves.last

    @property
    def resumed_from(self) -> int | None:
        """The step this process resumed from (None when it started from scratch)."""
        return self.saves.resumed_from

    @property
    def step(self) -> int:
        return self.state.counters.step

    @property
    def last_stall_seconds(self) -> float | None:
        """How long the last save blocked the loop (None before the first)."""
        return self.checkpointer.last_stall_seconds

    @property
    def target_reached(self) -> bool:
        if self.target_samples is not None:
            return self.state.counters.samples_seen >= self.target_samples
        return self.config.steps is not None and self.step >= self.config.steps

    @property
    def target_steps(self) -> int | None:
        """The step the run ends at, at this world size (runner.session.length)."""
        return steps_of(self.target_samples, self.state, steps=self.config.steps)

    @property
    def should_stop(self) -> bool:
        """True once the loop must end: the run is complete or a stop was requested (with
        several ranks: a stop they agreed on at the last step boundary)."""
        return self.target_reached or self.placement.stopping

    # -- resume -------------------------------------------------------------------------------

    def restore(self) -> int | None:
        """Continue from the newest checkpoint that verifies (local or mirror); returns its step.

        The store-bound part runs in a worker that a stop request gives up on
        (runner.preemption.startup): then nothing is restored or trained, `should_stop` is
        true and `finish()` exits 75 without saving or uploading anything."""
        started = time.monotonic()
        step = self._restore()
        self.attempt.ready(
            seconds=time.monotonic() - started, step=step or 0, world_size=self.rank.world_size
        )
        return step

    def _restore(self) -> int | None:
        if self.placement.cleans_partials(self.rank):
            self.writer.cleanup_partial()
        self.placement.before_resume(self.rank, self.ckpt_dir)
        try:
            point = self.placement.newest(self._read_newest, self.checkpointer.read)
        except StartupInterrupted as exc:
            self._give_up_startup(exc)
            self._agree_startup()
            return None
        self._set_target(point)
        if point is None:
            self._from_scratch()
            return None
        point, counters = self.placement.resume(
            point, load=self._resume_from, chosen=self._set_target, read=self.checkpointer.read
        )
        if self.mirror is not None and point.checkpoint.store_uri is None:
            try:
                keep_mirrored(point, mirror=self.mirror, stop=self.stop, metrics=self.metrics)
            except StartupInterrupted as exc:
                self._give_up_startup(exc)
        self._agree_startup()
        if counters.step < point.step and not self.startup_given_up:
            rebase(
                new_step=counters.step,
                resumed_step=point.step,
                run_dir=self.run_dir,
                ckpt_dir=self.ckpt_dir,
                primary=self.rank.acts_as_primary,
                save=lambda: self.save(reason="rescaled"),
                mirror=self.mirror,
                only_copy=self.placement.store_uri is not None,
            )
        return counters.step

    def _from_scratch(self) -> None:
        report_from_scratch(
            self.run_dir,
            loss_log=self.loss_log,
            metrics=self.metrics,
            announce=self.rank.acts_as_primary,
        )
        self.policy = self._policy(start_step=0)
        self._agree_startup()

    def _agree_startup(self) -> None:
        # several ranks: start-up given up on one is given up on all (none trains alone)
        self.startup_given_up = self.placement.agree_startup(given_up=self.startup_given_up)

    def _set_target(self, point: ResumePoint[dict[str, Any]] | None) -> None:
        self.target_samples = fixed_length(
            self.state,
            steps=self.config.steps,
            resumed=point.manifest if point is not None else None,
            in_samples=self.placement.fixes_length_in_samples,
            announce=self.rank.acts_as_primary,
        )

    def _resume_from(self, point: ResumePoint[dict[str, Any]]) -> Counters:
        """Load what the resolver's worker read into the live objects, on this thread
        (Checkpointer.read only read it); the run continues as the checkpoint's run."""
        try:
            counters = self.placement.load(self.state, point, writer=self.writer)
        except RunnerError:
            if self.metrics is not None:
                self.metrics.checkpoint_failed("restore")
            raise
        self.saves.resumed(point.step)
        self.resumed_checkpoint = point.checkpoint
        self.writer.run_id = point.manifest.run_id
        self.policy = self._policy(start_step=counters.step)
        report_resumed(
            point,
            counters,
            run_dir=self.run_dir,
            history=self.state.loss_history,
            steps=self.config.steps,
            loss_log=self.loss_log,
            metrics=self.metrics,
            announce=self.rank.acts_as_primary,
        )
        return counters

    def _give_up_startup(self, exc: StartupInterrupted) -> None:
        self.startup_given_up = True
        report_startup_given_up(exc, resumed_from=self.resumed_from, ckpt_dir=self.ckpt_dir)

    def _read_newest(self) -> ResumePoint[dict[str, Any]] | None:
        return read_newest(
            self.run_dir,
            stop=self.stop,
            checkpointer=self.checkpointer,
            mirror=self.mirror,
            metrics=self.metrics,
            fresh_start=self.config.fresh_start,
            refusals_reported=self._refusals_reported,
        )

    def _policy(self, *, start_step: int) -> SavePolicy:
        return SavePolicy.of_run(self.config, primary=self.rank.acts_as_primary, start=start_step)

    # -- the step boundary --------------------------------------------------------------------

    def step_done(self) -> bool:
        """Call after every optimizer step. Saves when due; returns `should_stop`."""
        if self.startup_given_up:
            # a loop that trains before asking should_stop took a step from state that start-up
            # never restored: it is not logged (it would overwrite the audit line of a real
            # step) and finish() does not save it
            return True
        counters = self.state.counters
        self.loss_log.append_newest(counters.step, self.state.loss_history)
        self.attempt.step(counters.step, saving=self.checkpointer.saving)
        if (interval := self.attempt.interval) is not None:  # --ckpt-every-seconds auto
            self.policy.every_seconds = interval
        if self.metrics is not None:
            self.metrics.train_step(counters.step)
        self.checkpointer.raise_failures()
        self.placement.step_ended(
            step=counters.step, policy=self.policy, grace_seconds=self.config.grace_seconds
        )
        if self.should_stop:
            return True  # the final checkpoint is written by finish()
        reason = self.placement.save_reason(step=counters.step, policy=self.policy)
        if reason is not None:
            try:
                self._start_save(reason=reason)  # committed in the background (async)
            except CheckpointWriteError as exc:
                # Training goes on (the failure metric and alert tell the operator); the next
                # try is at the next cadence point, not at every step.
                self.policy.saved(counters.step)
                log.error("%s; training continues", exc)
        return False

    def save(self, *, reason: str) -> CommittedCheckpoint:
        """Commit a checkpoint of the current state now, and hand it to the mirror; returns
        once it is committed (in either save mode).

        The loss log's fsync, capture, the placement's commit, then the bookkeeping,
        retention and mirror hand-off of runner.session.saves."""
        return self._start_save(reason=reason).result()

    def _start_save(self, *, reason: str) -> PendingSave:
        """`save`, returning once the loop may go on: a background saver commits it later,
        and its failure is reported at the next step boundary (training goes on)."""
        extra = carried_length(self.target_samples, steps=self.config.steps)
        # the step is saved from now on: the cadence moves on even while it is written
        self.policy.saved(self.step)
        try:
            pending = self.checkpointer.save(self.state, reason=reason, extra=extra)
        finally:
            if self.last_stall_seconds is not None:
                if self.metrics is not None:
                    self.metrics.checkpoint_stalled(self.last_stall_seconds)
                self.attempt.saved(step=self.step, stall_seconds=self.last_stall_seconds)
        return pending

    # -- the end ------------------------------------------------------------------------------

    def finish(self) -> int:
        """Commit the final checkpoint (and upload it within the deadline); returns the exit
        code: 0 when the run reached its step target, 75 when it stopped on request (SIGTERM,
        a preemption notice) with the final checkpoint committed."""
        stopped = self.placement.stopping and not self.target_reached
        if stopped:
            self.attempt.stopped(self.stop.reason)
        started = time.monotonic()
        ckpt = self._save_final(reason="stop" if stopped else "final")
        self.final_save_seconds = time.monotonic() - started
        if ckpt is None:
            ckpt = self.resumed_checkpoint  # nothing new: the one resumed from must be mirrored
        ending = end_run(
            mirror=None if self.startup_given_up else self.mirror,
            ckpt=ckpt,
            stop=self.stop,
            grace_seconds=self.config.grace_seconds,
            stopped=stopped,
        )
        self.final_upload_landed = ending.landed
        self.placement.after_final()  # several ranks wait for rank 0's final upload
        elapsed = time.monotonic() - started
        if stopped:
            where = durable_where(
                ckpt,
                startup_given_up=self.startup_given_up,
                mirror=self.mirror,
                landed=ending.landed,
            )
            report_stop(
                ckpt,
                reason=self.stop.reason,
                step=self.step,
                where=where,
                elapsed=elapsed,
                grace_seconds=self.config.grace_seconds,
            )
        self.exit_code = ending.exit_code
        self.attempt.ended(
            exit_code=self.exit_code,
            last_step=self.step,
            deadline=stop_deadline(self.stop, grace_seconds=self.config.grace_seconds),
        )
        if self.exit_code == EXIT_FAILURE and ckpt is not None:
            assert self.mirror is not None  # the final upload failed: there is a mirror
            report_not_mirrored(ckpt, mirror=self.mirror, run_dir=self.run_dir)
        return self.exit_code

    def _save_final(self, *, reason: str) -> CommittedCheckpoint | None:
        """The checkpoint of the current step, saved now unless it is committed already;
        None when there is nothing to save."""
        self.checkpointer.wait_for_saving()  # a background save in flight ends first
        self.checkpointer.raise_failures()
        ckpt = self.last_checkpoint
        if ckpt is not None and ckpt.step == self.step:
            return ckpt
        if self.startup_given_up:
            return None  # whatever the loop did after start-up was given up is not saved
        if self.step == 0 and self.resumed_from is None:
            return None  # nothing trained, nothing to save
        if self.resumed_from == self.step and self.last_checkpoint is None:
            return None  # stopped right after resuming: the checkpoint we resumed from stands
        return self.save(reason=reason)
