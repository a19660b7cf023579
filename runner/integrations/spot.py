"""What every framework callback does, whatever the framework: a trainer that keeps its own
loop and writes its own checkpoint files, told when to save and stop, its files committed.

    spot = SpotRun(config)               # signal handlers, run dir lock, metrics, mirror
    spot.attach()                        # once torch.distributed is up (every rank)
    path = spot.resume(root)             # newest verified (run dir ∪ mirror), put back under root
    stop, save = spot.step_ended(step)   # after every optimizer step (every rank)
    spot.saved(path, step, final=...)    # once the trainer wrote checkpoint `path` (every rank)
    code = spot.end(finished=...)        # 0 done, 75 stopped, 1 lost (every rank)

The stop is agreed by every rank at one step end (runner.session.placement); the trainer's
checkpoint is committed as a `files` checkpoint by rank 0 once every rank wrote its part
(runner.checkpoint.tree), handed to the mirror, and the older ones pruned. Ranks on several
nodes are not supported here: each node's rank 0 would commit only its node's files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from runner.checkpoint.formats.files import restore
from runner.checkpoint.layout import CHECKPOINTS_DIR
from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.manifest import FORMAT_FILES
from runner.checkpoint.retention import prune
from runner.checkpoint.tree import commit_tree
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.collective.group import SINGLE, Group
from runner.config import RunConfig
from runner.errors import EXIT_FAILURE, EXIT_OK, ConfigError, RunnerError
from runner.preemption.policy import SavePolicy
from runner.preemption.signals import install_signal_handlers
from runner.preemption.startup import StartupInterrupted
from runner.preemption.stop import StopController
from runner.runtime.lifecycle import end_run, find_resume, report_resume
from runner.runtime.rank import launch_context
from runner.runtime.services import lock_and_serve
from runner.session.coordination import agree_on_settings, decided_on_primary
from runner.session.placement import OneProcess, Placement, RanksOnOneNode, ranks_group
from runner.session.resume import keep_mirrored
from runner.storage.file import FileStorage

if TYPE_CHECKING:
    from runner.checkpoint.resume_point import ResumePoint

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_or_exit(work: Callable[[], T], spot: SpotRun | None = None) -> T:
    """`work()`, a spot-runner error (a refused checkpoint, bad settings) turned into its exit
    code and its message, the run's services released first: a user's error inside a
    framework's callback is no traceback."""
    try:
        return work()
    except RunnerError as exc:
        log.error("%s", exc)
        if spot is not None:
            spot.close()
        raise SystemExit(exc.exit_code) from None


class SpotRun:
    """One run of a framework's trainer under spot-runner (see the module's docstring)."""

    def __init__(
        self, config: RunConfig, *, integration: str, stop: StopController | None = None
    ) -> None:
        """Installs the signal handlers at once (from the main thread): a SIGTERM while the
        model loads is a stop at the first step. `stop`: the caller's controller (its
        handlers then are the caller's to install)."""
        if config.ckpt_every_seconds_auto:
            raise ConfigError(
                f"--ckpt-every-seconds auto is not supported by the {integration} callback yet "
                "(the framework decides its own saves): give a number of seconds"
            )
        self.config = config
        self.integration = integration
        self.rank = launch_context(os.environ)
        self._owned = contextlib.ExitStack()
        if stop is None:
            stop = StopController()
            restore_handlers = install_signal_handlers(stop, grace_seconds=config.grace_seconds)
            self._owned.callback(restore_handlers)
        self.stop = stop
        try:
            _, services = lock_and_serve(self._owned, config, stop, self.rank, None)
        except BaseException:
            self._owned.close()
            raise
        self.metrics = services.metrics
        self.mirror = services.mirror
        self.run_dir = Path(config.run_dir)
        self.writer = CheckpointWriter(
            self.run_dir / CHECKPOINTS_DIR, run_id=uuid.uuid4().hex[:16], writer_id=config.writer_id
        )
        # the run's loss history (what `runner drill` and `runner status` read): one writer
        self.loss_log = LossLog(
            self.run_dir,
            attempt=config.writer_id,
            on_failure=self._loss_log_failed,
            writes=self.rank.acts_as_primary,
        )
        self._owned.callback(self.loss_log.close)
        self.group: Group = SINGLE
        self.placement: Placement = OneProcess(stop)
        # the step cadence is the framework's own (save_steps, every_n_train_steps); a seconds
        # cadence (--ckpt-every-seconds) adds saves, decided on the primary
        self.policy = self._policy(start=0)
        self.attached = False
        self.startup_given_up = False
        self.resumed: CommittedCheckpoint | None = None
        self.last: CommittedCheckpoint | None = None
        self.stopped_at: int | None = None
        self.exit_code: int | None = None
        self._known_good: set[int] = set()

    def _loss_log_failed(self) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint_failed("loss_log")

    def _policy(self, *, start: int) -> SavePolicy:
        seconds = self.config.ckpt_every_seconds if self.rank.acts_as_primary else None
        return SavePolicy(every_steps=None, every_seconds=seconds, start_step=start)

    # -- start --------------------------------------------------------------------------------

    def attach(self) -> None:
        """The ranks' channel and their agreement on the run's settings; every rank, once
        torch.distributed is initialised (a framework's trainer does it)."""
        if self.attached:
            return
        self.attached = True
        if self.rank.multi_node:
            raise ConfigError(
                f"the {self.integration} callback runs ranks on one node only: on several nodes "
                "each node's rank 0 would commit only its own node's files. Use `runner run "
                "--adopt` around the job, or one node"
            )
        self.group = ranks_group(self.rank, self.config)
        agree_on_settings(self.group, self.config, node=self.rank.node_rank)
        if not self.group.single:
            self.placement = RanksOnOneNode(self.stop, self.group, self.group)
        if self.rank.acts_as_primary:
            self.writer.cleanup_partial()

    def resume(self, root: Path) -> Path | None:
        """The newest checkpoint that verifies (run dir ∪ mirror), put back under `root`
        byte for byte (rank 0, on the shared disk); its path on every rank, or None. A stop
        during the search gives start-up up: None, and the run stops at its first step
        without saving."""
        self.attach()

        def find() -> tuple[str, CommittedCheckpoint] | None:
            point = find_resume(
                self.run_dir,
                stop=self.stop,
                mirror=self.mirror,
                metrics=self.metrics,
                fresh_start=self.config.fresh_start,
            )
            if point is None:
                return None
            self._check_format(point)
            restored = restore(point.step_dir, point.manifest, root=root)
            # steps logged past it by the attempt that was lost are superseded
            report_resume(
                point,
                run_dir=self.run_dir,
                loss_log=self.loss_log,
                metrics=None,
                announce=False,
                mark_from_scratch=False,
            )
            if self.mirror is not None and point.checkpoint.store_uri is None:
                keep_mirrored(point, mirror=self.mirror, stop=self.stop, metrics=self.metrics)
            log.info(
                "resuming from checkpoint step %d: %s %s",
                point.step,
                "restored to" if restored.copied else "verified in place at",
                restored.path,
            )
            return str(restored.path), point.checkpoint

        try:
            chosen = decided_on_primary(self.group, find)
        except StartupInterrupted as exc:
            log.warning("%s: the run stops before its first step, saving nothing", exc)
            self.startup_given_up = True
            return None
        if chosen is None:
            if self.rank.acts_as_primary:
                log.info(
                    "no checkpoint in %s%s: starting from scratch", self.run_dir, self._or_mirror
                )
            return None
        path, checkpoint = chosen
        self.resumed = checkpoint
        self._known_good.add(checkpoint.step)
        self.writer.run_id = checkpoint.manifest.run_id
        self.policy = self._policy(start=checkpoint.step)
        if self.metrics is not None:
            self.metrics.resumed()
        return Path(path)

    @property
    def _or_mirror(self) -> str:
        return f" or {self.config.mirror}" if self.mirror is not None else ""

    def _check_format(self, point: ResumePoint[None]) -> None:
        if point.manifest.format != FORMAT_FILES:
            raise ConfigError(
                f"{point.step_dir} is a {point.manifest.format} checkpoint, not one a "
                f"{self.integration} trainer wrote: this run dir belongs to another job. Give "
                "this one its own run_dir"
            )

    # -- the step boundary --------------------------------------------------------------------

    def step_ended(self, step: int, *, loss: float | None = None) -> tuple[bool, bool]:
        """After optimizer step `step`, on every rank: (stop now, save this step). `loss`:
        the step's, when the framework tells it (loss.jsonl, on the primary)."""
        if loss is not None:
            self.log_loss(step, loss)
        if self.metrics is not None:
            self.metrics.train_step(step)
        if self.startup_given_up:
            return True, False
        self.placement.step_ended(
            step=step, policy=self.policy, grace_seconds=self.config.grace_seconds
        )
        if self.placement.stopping:
            if self.stopped_at is None:
                self.stopped_at = step
                log.warning("stopping at step %d (%s): saving it", step, self.stop.reason)
            return True, True
        reason = self.placement.save_reason(step=step, policy=self.policy)
        if reason is not None:
            self.policy.saved(step)
            return False, True
        return False, False

    def saved(
        self,
        path: Path,
        step: int,
        *,
        final: bool,
        every_rank: bool = True,
        fingerprint: Callable[[], str] | None = None,
    ) -> None:
        """The trainer wrote checkpoint `step` at `path` (every rank its part, on every rank;
        `every_rank` False: rank 0 wrote it alone and calls this alone): rank 0 commits it,
        hands it to the mirror (the final and stop ones go up in `end`, within the deadline)
        and prunes. `fingerprint()`: the digest of the weights inside, in its manifest (what
        `runner drill` compares). A failed commit is logged and counted; training goes on."""
        if every_rank:
            self.group.barrier()  # every rank's files are in `path`
        if self.startup_given_up or not self.rank.acts_as_primary:
            return
        if self.last is not None and self.last.step == step:
            return  # saved twice at one step (a stop at the trainer's own last step)
        started = time.monotonic()
        self.loss_log.sync()  # the loss history at least as durable as the checkpoint
        try:
            ckpt = commit_tree(
                self.writer,
                path,
                step=step,
                source=path.name,
                extra={"integration": self.integration},
                fingerprint=fingerprint() if fingerprint is not None else "",
            )
        except (OSError, RunnerError) as exc:
            if self.metrics is not None:
                self.metrics.checkpoint_failed("save")
            log.error("checkpoint step %d (%s) was not committed: %s", step, path, exc)
            return
        seconds = time.monotonic() - started
        self.last = ckpt
        self._known_good.add(step)
        if self.metrics is not None:
            self.metrics.checkpoint_saved(
                step=step, duration_s=seconds, size_bytes=ckpt.manifest.total_bytes
            )
        log.info(
            "checkpoint step %d committed in %.2fs (%s, %d files, %.1f MB)",
            step,
            seconds,
            path,
            len(ckpt.manifest.files),
            ckpt.manifest.total_bytes / 1e6,
        )
        self._prune()
        if self.mirror is not None and not final and self.stopped_at is None:
            self.mirror.submit(ckpt)

    def log_loss(self, step: int, loss: float) -> None:
        """loss.jsonl's line for `step` (the primary writes; never raises)."""
        if step >= 1 and not self.startup_given_up:
            self.loss_log.append(step, loss)

    def _prune(self) -> None:
        in_flight = self.mirror.in_flight_steps() if self.mirror is not None else set()
        try:
            prune(
                FileStorage(self.run_dir),
                keep=self.config.keep,
                protect=in_flight,
                known_good=self._known_good,
            )
        except (OSError, RunnerError) as exc:  # retention never fails a run
            log.warning("local retention skipped: %s", exc)

    # -- the end ------------------------------------------------------------------------------

    def end(self, *, finished: bool) -> int:
        """On every rank once training is over: the final upload (within the stop's deadline),
        every rank waiting for it, then the services and the lock released. 0 finished (and
        mirrored), 75 stopped with the stop's checkpoint committed (or nothing to save), 1
        otherwise."""
        if self.exit_code is not None:
            return self.exit_code
        stopped = self.stopped_at is not None and not finished
        ckpt = self.last or self.resumed
        committed = self.startup_given_up or (
            self.rank.acts_as_primary
            and self.last is not None
            and self.last.step == self.stopped_at
        )
        # the other ranks learn whether rank 0 committed the stop's checkpoint
        (committed_on_0,) = self.group.agree((int(committed) if self.group.rank == 0 else 0,))
        try:
            ending = end_run(
                mirror=None if self.startup_given_up else self.mirror,
                ckpt=ckpt,
                stop=self.stop,
                grace_seconds=self.config.grace_seconds,
                stopped=stopped,
                final=bool(committed_on_0),
            )
            self.placement.after_final()  # torchrun stops every rank once one exits
        finally:
            self.close()
        self.exit_code = ending.exit_code
        if stopped:
            where = "not committed" if not committed_on_0 else self._where(ending.landed)
            log.warning("stopped at step %s: checkpoint %s", self.stopped_at, where)
        elif self.exit_code == EXIT_FAILURE:
            log.error("the final checkpoint did not reach %s: `runner push` it", self.config.mirror)
        elif self.exit_code == EXIT_OK and ckpt is None and self.rank.acts_as_primary:
            log.info("finished; the trainer saved no checkpoint for spot-runner to commit")
        return self.exit_code

    def abandon(self, why: str) -> int:
        """The trainer ended outside its loop (on this rank alone: no collective): the run
        is not done and its stop's checkpoint, if any, was never written. Exit 1."""
        if self.exit_code is None:
            self.exit_code = EXIT_FAILURE
            last = self.last or self.resumed
            stands = f"step {last.step}" if last is not None else "none"
            log.error("%s before it finished; the checkpoint that stands is %s", why, stands)
            self.close()
        return self.exit_code

    def _where(self, landed: bool | None) -> str:
        if not self.rank.acts_as_primary:
            return "committed by rank 0"
        if landed is None:
            return f"committed in {self.run_dir / CHECKPOINTS_DIR}"
        return "committed and mirrored" if landed else "committed locally, NOT mirrored"

    def close(self) -> None:
        """Services, the run dir lock and the signal handlers released (a stop's handlers keep
        ignoring late signals until exit)."""
        self._owned.close()
