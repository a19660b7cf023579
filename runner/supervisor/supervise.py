"""`runner run -- CMD`: supervise any trainer.

The trainer runs in its own process group with the environment of
runner/supervisor/environment.py (the README lists it). SIGTERM / SIGINT / SIGUSR1 (and cloud
preemption notices, as a SIGTERM) are forwarded to the group (runner/supervisor/watch.py;
torchrun's workers run in sessions of their own: runner/supervisor/torchrun.py);
seed `.bin` files it writes are checked, committed with a manifest, mirrored and handed back
on the next start.

How an attempt ends decides what happens next (`_run_once`): exit 0 finishes, 75 on its own
is passed on, 2 and 3 are passed on without a restart (a usage or integrity error repeats),
any other exit or a death by a signal we did not send is restarted with exponential backoff
up to `max_restarts` (runner/supervisor/restarts.py), then ChildFailedError shows each
attempt's last output. After a stop we forwarded, 75 only when a final checkpoint stands
(runner/supervisor/ending.py). Whatever the ending, every process the attempt left behind is
swept before anything else happens (runner/supervisor/reap.py). One node of several
(`torchrun --nnodes N`, N > 1) resolves, adopts and mirrors nothing: its ranks commit in the
mirror themselves and their exit code decides (runner/supervisor/multinode.py). The module is
about 350 lines so that one attempt's steps (`_run_once` and the methods it calls) read in
order.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from runner.checkpoint.layout import CHECKPOINTS_DIR
from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.manifest import FORMAT_FILES
from runner.checkpoint.resume_point import ResumePoint
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.config import RunConfig
from runner.errors import (
    EXIT_FAILURE,
    EXIT_INTEGRITY,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    ChildFailedError,
    ConfigError,
    RunnerError,
    TrainerIntegrityError,
    TrainerUsageError,
)
from runner.preemption.startup import StartupInterrupted
from runner.preemption.stop import StopController
from runner.runtime import runlock
from runner.runtime.lifecycle import find_resume, report_resume, stop_deadline
from runner.supervisor.adopt import payload_path
from runner.supervisor.adopt_files import FilesAdopter
from runner.supervisor.attempts import SupervisedAttempts
from runner.supervisor.child import (
    DEFAULT_TAIL_LINES,
    AttemptOutput,
    ChildProcess,
    describe_exit,
)
from runner.supervisor.ending import (
    finish_mirrored,
    finish_stopped,
)
from runner.supervisor.environment import child_env
from runner.supervisor.hooks import MetricsHook, MirrorHook
from runner.supervisor.multinode import MultiNode, supervisor_mode
from runner.supervisor.restarts import (
    ChildCrashed,
    give_up_message,
    refusal_message,
    restart_loop,
)
from runner.supervisor.torchrun import PlainTrainer, launcher_for
from runner.supervisor.tracking import CommitTracker
from runner.supervisor.watch import start_trainer, sweep, watch

log = logging.getLogger(__name__)

# Attempts whose output the give-up report shows (the last ones), each with its last lines.
ATTEMPTS_SHOWN = 10

__all__ = ["MetricsHook", "MirrorHook", "Supervisor"]


class Supervisor:
    def __init__(
        self,
        command: Sequence[str],
        *,
        config: RunConfig,
        controller: StopController,
        mirror: MirrorHook | None = None,
        metrics: MetricsHook | None = None,
        restart_backoff: float = 1.0,
        max_backoff: float = 60.0,
        scan_interval: float = 0.2,
        tail_lines: int = DEFAULT_TAIL_LINES,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
    ) -> None:
        if not command:
            raise ConfigError("runner run needs a trainer command after `--`")
        self.command = list(command)
        self.config = config
        self.controller = controller
        # one node of several: the ranks own the mirror (runner/supervisor/multinode.py)
        self.mode = supervisor_mode(self.command, config)
        self.mirror = mirror if self.mode.owns_checkpoints else None
        self.metrics = metrics
        self.restart_backoff = restart_backoff
        self.max_backoff = max_backoff
        self.scan_interval = scan_interval
        self.run_dir = Path(config.run_dir).absolute()
        self.ckpt_dir = self.run_dir / CHECKPOINTS_DIR
        self.writer = CheckpointWriter(
            self.ckpt_dir, run_id=self.run_dir.name, writer_id=config.writer_id
        )
        self.files = self._files_adopter()
        self.commits = CommitTracker(
            self.run_dir,
            writer=self.writer,
            keep=config.keep,
            mirror=self.mirror,
            metrics=metrics,
            files=self.files,
        )
        self._restored: Path | None = None  # where --adopt put the resumed checkpoint back
        self.tail_lines = tail_lines
        self.outputs: deque[AttemptOutput] = deque(maxlen=ATTEMPTS_SHOWN)
        self._stdout = stdout or sys.stdout.buffer
        self._stderr = stderr or sys.stderr.buffer
        self.attempts = 0
        # each trainer start's record (runner.goodput); none on one node of several
        self.records = SupervisedAttempts(
            self.run_dir,
            mirror=self.mirror,
            metrics=metrics if self.mode.owns_checkpoints else None,
        )
        self._run_lock: runlock.RunDirLock | None = None

    def _files_adopter(self) -> FilesAdopter | None:
        """--adopt: the trainer's own checkpoints, matched in its working directory (ours)."""
        if not self.config.adopt:
            return None
        if not self.mode.owns_checkpoints:
            raise ConfigError(
                "--adopt works on one node: on several, the ranks commit in the mirror "
                "themselves (run one `runner run --adopt` per node without --nnodes > 1)"
            )
        return FilesAdopter(
            self.config.adopt,
            root=Path.cwd(),
            writer=self.writer,
            quiet_seconds=self.config.adopt_quiet_seconds,
        )

    @property
    def last_checkpoint(self) -> CommittedCheckpoint | None:
        """The newest checkpoint committed (or resumed from) so far."""
        return self.commits.last_checkpoint

    # -- the whole run -------------------------------------------------------------------------
    def run(self) -> int:
        """0 when the trainer finished, 75 when stopped (signal or notice); raises
        ChildFailedError once the trainer crashed more than `max_restarts` times."""
        # One writer per run dir, held for the supervisor's life: a second supervisor or
        # trainer on it exits 2. A runner child gets the lock's token (environment.py) and
        # works under this lock instead of waiting on it (runner/runtime/runlock.py).
        with runlock.acquire(self.run_dir, command="runner run") as lock:
            self._run_lock = lock
            try:
                return self._run_locked()
            finally:
                self._run_lock = None
                if self.files is not None:
                    self.files.close()

    def _run_locked(self) -> int:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.writer.cleanup_partial()
        if (described := self.mode.describe()) is not None:
            log.info("%s", described)
        # files left by a trainer whose supervisor died
        self._adopt(settled=True, follow=False)
        if self.mode.owns_checkpoints:
            self.records.pull_history()
        try:
            return restart_loop(
                self._run_once,
                max_restarts=self.config.max_restarts,
                backoff=self.restart_backoff,
                max_backoff=self.max_backoff,
                # a stop during the backoff ends it; the next attempt sees the stop, exits 75
                wait=self.controller.wait,
            )
        except ChildCrashed as crash:
            raise ChildFailedError(
                give_up_message(
                    self.command,
                    crash,
                    attempts=self.attempts,
                    max_restarts=self.config.max_restarts,
                    ckpt_dir=self.ckpt_dir,
                    outputs=self.outputs,
                )
            ) from None

    # -- one trainer process -------------------------------------------------------------------
    def _run_once(self) -> int:
        """One attempt (its record: runner/supervisor/attempts.py, ended however it ends)."""
        if self.controller.stop_requested:
            log.warning("stop requested (%s) before the trainer started", self.controller.reason)
            return EXIT_PREEMPTED
        self.attempts += 1
        if self.mode.owns_checkpoints:
            self.records.begin()
        code = EXIT_FAILURE
        try:
            code = self._attempt()
        except ChildCrashed as crash:
            code = crash.code
            raise
        except RunnerError as exc:
            code = exc.exit_code
            raise
        finally:
            last = self.last_checkpoint
            self.records.end(
                exit_code=code,
                fallback_step=last.step if last is not None else None,
                deadline=self._deadline(),
            )
        return code

    def _attempt(self) -> int:
        """Find what to resume from, start the trainer and watch it; how it ended decides
        the exit code (or a restart: ChildCrashed)."""
        resolving = time.monotonic()
        try:
            resume = self._resume_point() if self.mode.owns_checkpoints else None
        except StartupInterrupted as exc:
            log.warning("%s; the trainer was not started, nothing was trained", exc)
            return EXIT_PREEMPTED
        # A SIGUSR1 that arrived while no trainer ran is dropped: forwarded to a new process
        # before it installs its handler, it would kill it (SIGUSR1's default action).
        self.controller.take_checkpoint_request()
        if self.controller.stop_requested:  # arrived while looking for the checkpoint
            log.warning("stop requested (%s) before the trainer started", self.controller.reason)
            return EXIT_PREEMPTED
        # torchrun: runner/supervisor/torchrun.py; on several nodes stops go to its workers
        launcher = launcher_for(self.command, stop_workers=self.mode.stops_workers)
        step = resume.step if resume is not None else None
        self.records.resolved(seconds=time.monotonic() - resolving, step=step)
        child, output = self._start(resume, launcher)
        self.records.spawned(step=step)  # the trainer's own events sort after it by time
        try:
            watched = watch(
                child,
                self.controller,
                scan_interval=self.scan_interval,
                scan=self._scan,
                before_stop=self.commits.record_step_at_stop,
                metrics=self.metrics,
                launcher=launcher,
            )
        except BaseException:
            # The supervisor itself failed: do not leave the trainer running unsupervised.
            child.terminate(grace_seconds=min(10.0, self.config.grace_seconds))
            child.sweep(grace_seconds=1.0)
            raise
        code = child.finish(deadline=self.controller.deadline)  # a stop's, else None
        # Before judging its files or starting another attempt: nothing it started may still
        # write into the checkpoint directory.
        sweep(child, self.controller)
        output.ended = f"{describe_exit(code)} after {time.monotonic() - child.started_at:.1f} s"
        code = launcher.exit_code(code)  # torchrun's 1 for workers that all exited 75, ...
        if watched.stop_sent_at is not None:
            self.records.stop_forwarded(self.controller.reason)
        self._adopt(settled=True)
        if watched.stop_sent_at is not None and isinstance(self.mode, MultiNode):
            took = time.monotonic() - watched.stop_sent_at
            grace = self.config.grace_seconds
            return self.mode.finish_stop(code, killed=watched.killed, took=took, grace=grace)
        if watched.stop_sent_at is not None:
            mute = launcher.mute_exit(code)
            return self._unless_lost(
                self._finish_stop(code, watched.stop_sent_at, killed=watched.killed, mute=mute)
            )
        return self._ended_on_its_own(code)

    def _resume_point(self) -> ResumePoint[None] | None:
        """The checkpoint this attempt resumes from (verified; the trainer loads it itself),
        with the steps the last attempt lost past it reported; StartupInterrupted when a stop
        gave up on the search (a store that never answers could outlast the grace period)."""
        resume = find_resume(
            self.run_dir,
            stop=self.controller,
            mirror=self.mirror,
            metrics=self.metrics,
            fresh_start=self.config.fresh_start,
        )
        if resume is not None:
            # the newest checkpoint may predate this process (a retry after a failed upload):
            # a finish or stop with nothing new written still makes sure it is in the mirror
            self.commits.seen(resume.checkpoint)
        self._restored = None
        if resume is not None and resume.manifest.format == FORMAT_FILES:
            if self.files is not None:  # back where the trainer wrote it, byte for byte
                self._restored = self.files.restore(resume.step_dir, resume.manifest).path
            else:
                log.warning(
                    "step %d is a trainer's own checkpoint (files): without --adopt it is "
                    "handed over where it is, in the run dir, not put back",
                    resume.step,
                )
        # Steps the last attempt logged past this checkpoint are lost: counted, and marked
        # superseded in loss.jsonl; the "started trainer" line says where it resumes.
        with LossLog(self.run_dir, attempt=f"{self.config.writer_id}/{self.attempts}") as losses:
            report_resume(
                resume,
                run_dir=self.run_dir,
                loss_log=losses,
                metrics=self.metrics,
                attempt=self.attempts,
                announce=False,
            )
        return resume

    def _start(
        self, resume: ResumePoint[None] | None, launcher: PlainTrainer
    ) -> tuple[ChildProcess, AttemptOutput]:
        output = AttemptOutput(self.attempts, self.tail_lines, launcher.observe)
        self.outputs.append(output)
        env = child_env(
            self.config,
            run_dir=self.run_dir,
            ckpt_dir=self.ckpt_dir,
            resume=resume,
            attempt=self.attempts,
            run_lock=self._run_lock,
            mirror=self.mode.trainer_mirror,
            resume_path=self._restored,
        )
        env.update(self.records.env())
        launcher.environment(env, grace_seconds=self.config.grace_seconds)
        child = start_trainer(
            self.command,
            env=env,
            output=output,
            stdout=self._stdout,
            stderr=self._stderr,
            lock_fd=self._run_lock.fd if self._run_lock is not None else None,
            resume_from=self._resume_text(resume),
        )
        return child, output

    def _resume_text(self, resume: ResumePoint[None] | None) -> str:
        if resume is not None:
            return str(self._restored or payload_path(resume.step_dir, resume.manifest))
        return self.mode.without_resume()

    def _ended_on_its_own(self, code: int) -> int:
        """The trainer exited without a stop from us: 0 and 75 are passed on (0 once the
        mirror holds the newest checkpoint), 2 and 3 refused, anything else restarted."""
        self.commits.report_step()
        if code == EXIT_OK:
            log.info("trainer finished (exit 0)")
            with self.commits.final_upload(self.last_checkpoint, deadline=self._deadline()):
                code = finish_mirrored(
                    self.last_checkpoint,
                    mirror=self.mirror,
                    stop=self.controller,
                    grace_seconds=self.config.grace_seconds,
                    run_dir=self.run_dir,
                    nothing_stands=self.commits.nothing_stands(),
                )
            return self._unless_lost(code)
        if code == EXIT_PREEMPTED:
            log.warning("trainer exited 75 on its own (preempted); passing it on")
            return self._unless_lost(EXIT_PREEMPTED)
        if code in (EXIT_USAGE, EXIT_INTEGRITY):
            message = refusal_message(
                self.command, code, ckpt_dir=self.ckpt_dir, outputs=self.outputs
            )
            if code == EXIT_USAGE:
                raise TrainerUsageError(message)
            raise TrainerIntegrityError(message)
        raise ChildCrashed(code)

    def _unless_lost(self, code: int) -> int:
        """`code`, unless the trainer's newest checkpoint was rejected (or left open for
        writing) and nothing later was committed: then exit 3 (CheckpointNotAdoptedError),
        after the mirror work above, so that no one takes the run for done or safely stopped;
        nor when a re-base is unfinished in the mirror (exit 1, runner/supervisor/rebased.py)."""
        self.commits.raise_if_lost()
        return self.commits.unless_rebase_unfinished(code)

    def _finish_stop(self, code: int, stop_sent_at: float, *, killed: bool, mute: bool) -> int:
        """After a stop we forwarded: 75 only when a final checkpoint stands, else 1 (2 or 3
        when the trainer exited so); runner/supervisor/ending.py judges which stands (`mute`:
        the exit code says nothing, torchrun's)."""
        took = time.monotonic() - stop_sent_at
        judged = self.commits.judge_stop(code=code, killed=killed, mute_exit=mute)
        with self.commits.final_upload(judged.ckpt, deadline=self._deadline()):
            return finish_stopped(
                judged,
                code=code,
                killed=killed,
                took=took,
                mirror=self.mirror,
                stop=self.controller,
                grace_seconds=self.config.grace_seconds,
                ckpt_dir=self.ckpt_dir,
                nothing_stands=self.commits.nothing_stands(),
            )

    def _deadline(self) -> float | None:
        return stop_deadline(self.controller, grace_seconds=self.config.grace_seconds)

    # -- checkpoints -----------------------------------------------------------------------------
    def _scan(self) -> None:
        self._adopt(settled=False)
        self.commits.report_step()
        self.records.refresh()

    def _adopt(self, *, settled: bool, follow: bool = True) -> None:
        """The trainer's seed files adopted and, with `follow`, the checkpoint dirs it
        committed itself counted (not before the first attempt: resume verifies those). Not on
        one node of several: its ranks commit in the mirror, its run dir holds no checkpoint."""
        if not self.mode.owns_checkpoints:
            return
        stopping = self.controller.stop_requested
        self.commits.adopt(settled=settled, stopping=stopping)
        if follow:
            self.commits.follow_committed(stopping=stopping)
