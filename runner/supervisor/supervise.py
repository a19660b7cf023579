"""`runner run -- CMD`: supervise any trainer.

The trainer runs in its own process group with the environment of `_child_env` (the README
lists it). SIGTERM / SIGINT / SIGUSR1 (and cloud preemption notices, as a SIGTERM) are
forwarded to the group; seed `.bin` files it writes are checked, committed with a manifest,
mirrored and handed back on the next start.

How an attempt ends decides what happens next (`_run_once`): exit 0 finishes, 75 on its own
is passed on, 2 and 3 are passed on without a restart (a usage or integrity error repeats),
any other exit or a death by a signal we did not send is restarted with exponential backoff
up to `max_restarts`, then ChildFailedError shows each attempt's last output. After a
stop we forwarded, 75 only when a final checkpoint stands (`_finish_stop`). Whatever the
ending, every process the attempt left behind is swept before anything else happens
(runner/supervisor/reap.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from runner.checkpoint.layout import CHECKPOINTS_DIR, parse_seed_bin, parse_step_dir
from runner.checkpoint.listing import read_manifest_dir
from runner.checkpoint.retention import prune
from runner.checkpoint.sidecars import LossFollower, LossLog
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
from runner.runtime.lifecycle import ResumePoint, ResumeSource, end_run, find_resume, report_resume
from runner.storage.file import FileStorage
from runner.supervisor.adopt import Adopted, SeedAdopter, payload_path
from runner.supervisor.child import (
    DEFAULT_TAIL_LINES,
    AttemptOutput,
    ChildProcess,
    describe_exit,
)
from runner.supervisor.reap import SWEEP_GRACE_SECONDS

log = logging.getLogger(__name__)

ENV_RUN_DIR = "RUNNER_RUN_DIR"
ENV_CKPT_DIR = "RUNNER_CKPT_DIR"
ENV_RESUME_FROM = "RUNNER_RESUME_FROM"
# The manifest's format (seed-bin, torch-state, torch-chunked): a trainer checks it before
# parsing RUNNER_RESUME_FROM, so a payload it cannot read is refused, not misread.
ENV_RESUME_FORMAT = "RUNNER_RESUME_FORMAT"
ENV_RESUME_STEP = "RUNNER_RESUME_STEP"
ENV_ATTEMPT = "RUNNER_ATTEMPT"
# How often exited orphans of a running trainer are reaped (each time a scan of /proc).
REAP_INTERVAL_SECONDS = 1.0
# Attempts whose output the give-up report shows (the last ones), each with its last lines.
ATTEMPTS_SHOWN = 10
SUPERVISOR_ONLY_ENV = frozenset(
    {"RUNNER_MIRROR", "RUNNER_METRICS_PORT", "RUNNER_NOTICES", "RUNNER_NOTICE_ENDPOINT"}
)


class MirrorHook(ResumeSource, Protocol):
    """What the supervisor needs from the mirror (runner.mirror.Mirror fits): resume
    resolution over it (runner.runtime.lifecycle), uploads."""

    def submit(self, ckpt: CommittedCheckpoint) -> None: ...

    def upload_now(self, ckpt: CommittedCheckpoint, *, deadline: float | None = None) -> bool: ...

    def wait_idle(self, timeout: float | None = None) -> bool: ...


class MetricsHook(Protocol):
    """What the supervisor reports (runner.metrics.registry.RunnerMetrics fits)."""

    def checkpoint_saved(self, *, step: int, duration_s: float, size_bytes: int) -> None: ...

    def checkpoint_failed(self, stage: str) -> None: ...

    def preemption_notice(self, source: str) -> None: ...

    def resumed(self, *, steps_lost: int = 0) -> None: ...

    def train_step(self, step: int) -> None: ...

    def checkpoint_found(self, *, location: str, step: int, created_at: float) -> None: ...


class ChildCrashed(Exception):
    """One trainer run ended badly; tenacity decides whether to restart."""

    def __init__(self, code: int) -> None:
        super().__init__(describe_exit(code))
        self.code = code


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
        self.mirror = mirror
        self.metrics = metrics
        self.restart_backoff = restart_backoff
        self.max_backoff = max_backoff
        self.scan_interval = scan_interval
        self.run_dir = Path(config.run_dir).absolute()
        self.ckpt_dir = self.run_dir / CHECKPOINTS_DIR
        self.writer = CheckpointWriter(
            self.ckpt_dir, run_id=self.run_dir.name, writer_id=config.writer_id
        )
        self.adopter = SeedAdopter(self.run_dir, writer=self.writer)
        self.tail_lines = tail_lines
        self.outputs: deque[AttemptOutput] = deque(maxlen=ATTEMPTS_SHOWN)
        self._stdout = stdout or sys.stdout.buffer
        self._stderr = stderr or sys.stderr.buffer
        self.last_checkpoint: CommittedCheckpoint | None = None
        # the newest step committed or waiting to be adopted when the stop was forwarded
        self._step_at_stop: int | None = None
        self.attempts = 0
        self._loss = LossFollower(self.run_dir)
        self._step_from_loss = False
        # steps adopted by this process: retention need not re-hash them
        self._known_good: set[int] = set()
        self._run_lock: runlock.RunDirLock | None = None

    # -- the whole run -------------------------------------------------------------------------
    def run(self) -> int:
        """0 when the trainer finished, 75 when stopped (signal or notice); raises
        ChildFailedError once the trainer crashed more than `max_restarts` times."""
        # One writer per run dir, held for the supervisor's life: a second supervisor or
        # trainer on it exits 2. A runner child gets the lock's token (`_child_env`) and works
        # under this lock instead of waiting on it (runner/runtime/runlock.py).
        with runlock.acquire(self.run_dir, command="runner run") as lock:
            self._run_lock = lock
            try:
                return self._run_locked()
            finally:
                self._run_lock = None

    def _run_locked(self) -> int:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        self.writer.cleanup_partial()
        self._adopt(settled=True)  # files left by a trainer whose supervisor died
        retrying = Retrying(
            stop=stop_after_attempt(self.config.max_restarts + 1),
            wait=wait_exponential(multiplier=self.restart_backoff, max=self.max_backoff),
            retry=retry_if_exception_type(ChildCrashed),
            sleep=self._backoff_sleep,
            before_sleep=self._log_restart,
            reraise=True,
        )
        try:
            return retrying(self._run_once)
        except ChildCrashed as crash:
            raise ChildFailedError(self._failure_message(crash)) from None

    def _backoff_sleep(self, seconds: float) -> None:
        # A stop during the backoff ends it; the next attempt then sees the stop and exits 75.
        self.controller.wait(seconds)

    def _log_restart(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning(
            "trainer failed (%s); restart %d of %d in %.2f s",
            exc,
            state.attempt_number,
            self.config.max_restarts,
            delay,
        )

    def _failure_message(self, crash: ChildCrashed) -> str:
        restarts = self.config.max_restarts
        return (
            f"the trainer `{' '.join(self.command)}` failed {self.attempts} time(s), last with "
            f"{crash}; gave up after --max-restarts {restarts}. Fix the trainer (or raise "
            f"--max-restarts); checkpoints so far are kept in {self.ckpt_dir}. "
            f"{self._output_report()}"
        )

    def _refusal_message(self, code: int) -> str:
        what = "a usage or configuration error" if code == EXIT_USAGE else "an integrity failure"
        return (
            f"the trainer `{' '.join(self.command)}` exited {code} ({what}): not restarted, "
            f"it would fail the same way. Fix its command or inputs; checkpoints so far are "
            f"kept in {self.ckpt_dir}. {self._output_report()}"
        )

    def _output_report(self) -> str:
        """Each attempt's last lines under a header of its own, stdout and stderr in the
        order they were read."""
        first = self.outputs[0].attempt if self.outputs else 1
        hidden = f" (attempts 1 to {first - 1} not shown)" if first > 1 else ""
        lines = [line for output in self.outputs for line in output.render()]
        return f"Its last output, attempt by attempt{hidden}:\n" + "\n".join(lines)

    # -- one trainer process -------------------------------------------------------------------
    def _run_once(self) -> int:
        if self.controller.stop_requested:
            log.warning("stop requested (%s) before the trainer started", self.controller.reason)
            return EXIT_PREEMPTED
        self.attempts += 1
        try:
            # against a store that never answers this could outlast the grace period: a stop
            # gives it up (nothing was started, nothing is published after that); verified
            # is enough here, the trainer loads the checkpoint itself
            resume = find_resume(
                self.run_dir,
                stop=self.controller,
                mirror=self.mirror,
                metrics=self.metrics,
                fresh_start=self.config.fresh_start,
            )
        except StartupInterrupted as exc:
            log.warning("%s; the trainer was not started, nothing was trained", exc)
            return EXIT_PREEMPTED
        if resume is not None and (
            self.last_checkpoint is None or self.last_checkpoint.step < resume.step
        ):
            # the newest checkpoint may predate this process (a retry after a failed upload):
            # a finish or stop with nothing new written still makes sure it is in the mirror
            self.last_checkpoint = resume.checkpoint
        # Steps the last attempt logged past this checkpoint are lost: counted, and marked
        # superseded in loss.jsonl; the "started trainer" line below says where it resumes.
        with LossLog(self.run_dir, attempt=f"{self.config.writer_id}/{self.attempts}") as losses:
            report_resume(
                resume,
                run_dir=self.run_dir,
                loss_log=losses,
                metrics=self.metrics,
                attempt=self.attempts,
                announce=False,
            )
        # A SIGUSR1 that arrived while no trainer ran is dropped: forwarded to a new process
        # before it installs its handler, it would kill it (SIGUSR1's default action).
        self.controller.take_checkpoint_request()
        if self.controller.stop_requested:  # arrived while looking for the checkpoint
            log.warning("stop requested (%s) before the trainer started", self.controller.reason)
            return EXIT_PREEMPTED
        lock_fd = self._run_lock.fd if self._run_lock is not None else None
        output = AttemptOutput(self.attempts, self.tail_lines)
        self.outputs.append(output)
        child = ChildProcess(
            self.command,
            env=self._child_env(resume),
            stdout=self._stdout,
            stderr=self._stderr,
            tail=output.tail,
            # an orphaned trainer (supervisor SIGKILLed) keeps the run dir locked: no second
            # supervisor starts a second writer beside it
            pass_fds=() if lock_fd is None else (lock_fd,),
        )
        output.pid = child.pid
        log.info(
            "started trainer pid %d (attempt %d), resume from %s",
            child.pid,
            self.attempts,
            payload_path(resume.step_dir, resume.manifest) if resume else "scratch",
        )
        try:
            stop_sent_at, killed = self._watch(child)
        except BaseException:
            # The supervisor itself failed: do not leave the trainer running unsupervised.
            child.terminate(grace_seconds=min(10.0, self.config.grace_seconds))
            child.sweep(grace_seconds=1.0)
            raise
        code = child.finish(deadline=self.controller.deadline)  # a stop's, else None
        # Before judging its files or starting another attempt: nothing it started may still
        # write into the checkpoint directory.
        self._sweep(child)
        output.ended = f"{describe_exit(code)} after {time.monotonic() - child.started_at:.1f} s"
        self._adopt(settled=True)
        if stop_sent_at is not None:
            return self._unless_lost(self._finish_stop(code, stop_sent_at, killed=killed))
        self._report_step()
        if code == EXIT_OK:
            log.info("trainer finished (exit 0)")
            return self._unless_lost(self._finish_mirrored())
        if code == EXIT_PREEMPTED:
            log.warning("trainer exited 75 on its own (preempted); passing it on")
            return self._unless_lost(EXIT_PREEMPTED)
        if code == EXIT_USAGE:
            raise TrainerUsageError(self._refusal_message(code))
        if code == EXIT_INTEGRITY:
            raise TrainerIntegrityError(self._refusal_message(code))
        raise ChildCrashed(code)

    def _sweep_grace(self) -> float:
        """SIGTERM to SIGKILL for leftovers: short, shorter still near a stop deadline, and
        none (SIGKILL at once) once it has passed."""
        left = self.controller.time_left()
        if left is None:
            return SWEEP_GRACE_SECONDS
        return min(SWEEP_GRACE_SECONDS, max(0.0, left))

    def _sweep(self, child: ChildProcess) -> None:
        child.sweep(grace_seconds=self._sweep_grace())
        swept = child.swept  # including those swept while the output drained
        if swept:
            log.warning(
                "the trainer (pid %d) left %d process(es) running after it exited: "
                "terminated pids %s",
                child.pid,
                len(swept),
                " ".join(str(pid) for pid in swept),
            )

    def _unless_lost(self, code: int) -> int:
        """`code`, unless the trainer's newest checkpoint was rejected (or left open for
        writing) and nothing later was committed: then exit 3 (CheckpointNotAdoptedError),
        after the mirror work above, so that no one takes the run for done or safely stopped."""
        newest = self.last_checkpoint.step if self.last_checkpoint is not None else None
        self.adopter.raise_if_lost(newest)
        return code

    def _watch(self, child: ChildProcess) -> tuple[float | None, bool]:
        """Forward signals and adopt checkpoints until the trainer exits. Returns when the
        stop was forwarded (monotonic, None if the trainer ended on its own) and whether it
        was killed at the end of the grace period."""
        stop_sent_at: float | None = None
        killed = False
        next_reap = time.monotonic() + REAP_INTERVAL_SECONDS
        while child.poll() is None:
            if self.controller.stop_requested and stop_sent_at is None:
                stop_sent_at = self._forward_stop(child)
            if self.controller.take_checkpoint_request() is not None and stop_sent_at is None:
                log.info("forwarding SIGUSR1: the trainer checkpoints and continues")
                child.signal_group(signal.SIGUSR1)
            time_left = self.controller.time_left()
            if stop_sent_at is not None and not killed and time_left is not None and time_left <= 0:
                log.error(
                    "grace period over and the trainer is still running: killing its group; "
                    "the last checkpoint it committed is the one that counts"
                )
                child.signal_group(signal.SIGKILL)
                killed = True
            self._adopt(settled=False)
            self._report_step()
            if time.monotonic() >= next_reap:
                # exited orphans re-parented to us (a trainer running `cmd &`) are not left
                # as zombies until the pod's pid limit
                child.reap_orphans()
                next_reap = time.monotonic() + REAP_INTERVAL_SECONDS
            wait = self.scan_interval
            if time_left is not None and not killed:
                wait = max(0.0, min(wait, time_left))
            self.controller.wait_any(wait)
        return stop_sent_at, killed

    def _forward_stop(self, child: ChildProcess) -> float:
        reason = self.controller.reason or "stop"
        sig = signal.SIGINT if reason == "SIGINT" else signal.SIGTERM
        # Recorded before the signal: a checkpoint newer than this was committed during
        # the stop. A seed file renamed into place but not adopted yet was written before it.
        self._step_at_stop = self._newest_step_now()
        child.signal_group(sig)
        if reason in ("SIGTERM", "SIGINT") and self.metrics is not None:
            self.metrics.preemption_notice("sigterm")
        left = self.controller.time_left()
        log.warning(
            "%s: forwarded %s to the trainer; %s",
            reason,
            sig.name,
            f"{left:.1f} s of grace left" if left is not None else "no deadline",
        )
        return time.monotonic()

    def _finish_mirrored(self) -> int:
        """After a successful run, 0 only when the newest checkpoint is in the mirror; else 1,
        so a scheduler retries. `upload_now` finds an already uploaded checkpoint in place (one
        request) and otherwise tries once more in the caller's time."""
        newest = self.last_checkpoint
        if self.mirror is None or newest is None:
            return EXIT_OK
        # no deadline on a normal finish: a large checkpoint on a slow link is not a failure
        self.mirror.wait_idle(None)
        ending = end_run(
            mirror=self.mirror,
            ckpt=newest,
            stop=self.controller,
            grace_seconds=self.config.grace_seconds,
            stopped=False,
        )
        if ending.exit_code == EXIT_OK:
            return EXIT_OK
        log.error(
            "the trainer finished but checkpoint step %d is NOT in the mirror (errors above); "
            "the local copy in %s is complete: `runner push %s MIRROR` once the store is "
            "reachable. Exiting 1 so that a scheduler retries",
            newest.step,
            newest.path,
            self.run_dir,
        )
        return ending.exit_code

    def _finish_stop(self, code: int, stop_sent_at: float, *, killed: bool) -> int:
        """After a stop we forwarded: 75 only when a final checkpoint stands, else 1 (2 or 3
        when the trainer exited so). A final checkpoint is the newest committed one when

        - it was committed during this stop (its step is newer than every checkpoint
          committed, or seed file waiting to be adopted, when the stop was forwarded: a seed
          trainer's adopted .bin, or a checkpoint dir a runner child committed), or
        - the trainer exited 0 or 75 on its own (not killed at the deadline): its state at the
          stop was already committed, e.g. a runner child stopped right after a save;

        and, in both cases, the trainer's loss.jsonl (when it keeps one) logs no step past it
        and no seed file of a later step was left unadopted (then `_unless_lost` exits 3).
        """
        took = time.monotonic() - stop_sent_at
        grace = self.config.grace_seconds
        newest = self._newest_committed()
        if newest is not None and (
            self.last_checkpoint is None or newest.step > self.last_checkpoint.step
        ):
            self.last_checkpoint = newest  # committed by the trainer itself (a runner child)
        ckpt = self.last_checkpoint
        at_stop = self._step_at_stop
        fresh = ckpt is not None and (at_stop is None or ckpt.step > at_stop)
        clean = not killed and code in (EXIT_OK, EXIT_PREEMPTED)
        logged = self._last_logged_step()
        lost_steps = ckpt is not None and logged is not None and logged > ckpt.step
        # a newer file of the trainer's that was not adopted: its final one was lost
        rejected = ckpt is not None and any(
            item.step >= ckpt.step for item in self.adopter.not_adopted.values()
        )
        final = ckpt is not None and (fresh or clean) and not lost_steps and not rejected
        how = "killed at the end of the grace period" if killed else describe_exit(code)
        if ckpt is None:
            log.error(
                "trainer stopped (%s) without committing any checkpoint: none stands in %s, "
                "the next start begins from scratch",
                how,
                self.ckpt_dir,
            )
        elif final:
            log.warning(
                "trainer stopped (%s) %.2f s after the stop signal (grace %.0f s); "
                "%s checkpoint: step %d",
                how,
                took,
                grace,
                "final" if fresh else "final (already committed before the stop)",
                ckpt.step,
            )
        else:
            past = f"; steps up to {logged} it logged after it are lost" if lost_steps else ""
            log.error(
                "trainer stopped (%s) %.2f s after the stop signal (grace %.0f s) without "
                "committing a final checkpoint; the checkpoint that stands is step %d in %s, "
                "committed %s%s",
                how,
                took,
                grace,
                ckpt.step,
                ckpt.path,
                "during the stop" if fresh else "before the stop",
                past,
            )
        # within the stop's deadline (runner.runtime.lifecycle.stop_deadline)
        ending = end_run(
            mirror=self.mirror,
            ckpt=ckpt,
            stop=self.controller,
            grace_seconds=grace,
            stopped=True,
            final=final,
            stopped_without_final=(
                code if not killed and code in (EXIT_USAGE, EXIT_INTEGRITY) else EXIT_FAILURE
            ),
        )
        if ckpt is not None and ending.landed is not None:
            log.warning(
                "%s checkpoint step %d %s the mirror",
                "final" if final else "newest",
                ckpt.step,
                "is in" if ending.landed else "did NOT reach",
            )
        if self.controller.stop_count > 1:
            log.info("%d stop requests received; the first one decided", self.controller.stop_count)
        if ending.exit_code != EXIT_PREEMPTED:
            log.error(
                "exiting %d, not 75: no final checkpoint was committed for this stop",
                ending.exit_code,
            )
        return ending.exit_code

    def _newest_committed(self) -> CommittedCheckpoint | None:
        """The newest checkpoint directory with a valid manifest (committed; not hashed here:
        resume verifies it)."""
        try:
            entries = list(self.ckpt_dir.iterdir())
        except OSError:
            return None
        steps = sorted(
            ((step, e) for e in entries if (step := parse_step_dir(e.name)) is not None),
            reverse=True,
        )
        for step, step_dir in steps:
            try:
                manifest = read_manifest_dir(step_dir)
            except (OSError, RunnerError, ValueError):
                continue
            return CommittedCheckpoint(step=step, path=step_dir, manifest=manifest)
        return None

    def _newest_step_now(self) -> int | None:
        committed = self._newest_committed()
        steps = [parse_seed_bin(p.name) for p in self.adopter.pending()]
        known = [s for s in steps if s is not None]
        if committed is not None:
            known.append(committed.step)
        if self.last_checkpoint is not None:
            known.append(self.last_checkpoint.step)
        return max(known, default=None)

    def _last_logged_step(self) -> int | None:
        """The newest step in the trainer's loss.jsonl, None when it keeps none."""
        try:
            logged = LossLog(self.run_dir).read()
        except (OSError, RunnerError, ValueError):
            return None
        return max(logged, default=None)

    # -- checkpoints -----------------------------------------------------------------------------
    def _adopt(self, *, settled: bool) -> list[Adopted]:
        adopted = self.adopter.scan(settled=settled)
        for item in adopted:
            ckpt = item.checkpoint
            self.last_checkpoint = ckpt
            if self.metrics is not None and not self._step_from_loss:
                self.metrics.train_step(ckpt.step)  # the best we know without a loss log
            if self.metrics is not None:
                self.metrics.checkpoint_saved(
                    step=ckpt.step, duration_s=item.seconds, size_bytes=ckpt.manifest.total_bytes
                )
            if self.mirror is not None and not self.controller.stop_requested:
                self.mirror.submit(ckpt)  # the final one is uploaded in _finish_stop
        if adopted:
            prune(
                FileStorage(self.run_dir),
                keep=self.config.keep,
                newest_ok=adopted[-1].checkpoint.step,
                known_good=self._known_good,
            )
        if self.adopter.rejected and self.metrics is not None:
            for _ in self.adopter.rejected:
                self.metrics.checkpoint_failed("verify")
            self.adopter.rejected.clear()
        return adopted

    def _report_step(self) -> None:
        """The trainer's step, from its loss.jsonl when it keeps one."""
        step = self._loss.poll()
        if step is not None:
            self._step_from_loss = True
            if self.metrics is not None:
                self.metrics.train_step(step)

    def _child_env(self, resume: ResumePoint[None] | None) -> dict[str, str]:
        # The supervisor owns the mirror, the metrics port and the notice poller: a child
        # that is itself a runner (`runner run -- runner demo`) must not start its own.
        env = {k: v for k, v in os.environ.items() if k not in SUPERVISOR_ONLY_ENV}
        # Training settings given on the command line reach a runner child as well.
        for name, value in (
            ("RUNNER_STEPS", self.config.steps),
            ("RUNNER_CKPT_EVERY", self.config.ckpt_every),
            ("RUNNER_CKPT_EVERY_SECONDS", self.config.ckpt_every_seconds),
            ("RUNNER_KEEP", self.config.keep),
            ("RUNNER_GRACE_SECONDS", self.config.grace_seconds),
            ("RUNNER_SEED", self.config.seed),
        ):
            if value is not None:
                env[name] = str(value)
        env[ENV_RUN_DIR] = str(self.run_dir)
        env[ENV_CKPT_DIR] = str(self.ckpt_dir)
        env[ENV_RESUME_FROM] = str(payload_path(resume.step_dir, resume.manifest)) if resume else ""
        env[ENV_RESUME_FORMAT] = resume.manifest.format if resume else ""
        env[ENV_RESUME_STEP] = str(resume.step) if resume else ""
        env[ENV_ATTEMPT] = str(self.attempts)
        if self._run_lock is not None:
            env.update(self._run_lock.child_env())
        return env
