"""The run lifecycle every entry point shares (TrainSession, `runner run`): where a run
continues from, how that is reported, and how it ends (the final upload and the exit code).

TrainSession and the supervisor each used to carry a copy of every step, with a rule of its
own for the final upload's deadline when a stop carries none. What stays with a caller is
what only it knows: the session loads into live objects and commits its own final checkpoint;
the supervisor merely verifies, hands a path to a trainer, and judges the trainer's last
checkpoint after a stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, overload

from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.manifest import FORMAT_DCP, Manifest, created_at_unix
from runner.checkpoint.resume_point import ResumePoint
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import EXIT_FAILURE, EXIT_OK, EXIT_PREEMPTED
from runner.mirror.resume import SkipCallback, choose_resume
from runner.preemption.startup import run_interruptible
from runner.preemption.stop import StopController
from runner.state.counters import Counters

log = logging.getLogger(__name__)

T = TypeVar("T")


class ResumeSource(Protocol):
    """Checkpoints beyond the run dir (runner.mirror.Mirror fits)."""

    def choose_resume(
        self,
        run_dir: Path,
        *,
        load: Callable[[Path, Manifest], Any] | None = None,
        on_skip: SkipCallback | None = None,
        fresh_start: bool = False,
        refusal_log_level: int = logging.WARNING,
    ) -> ResumePoint[Any] | None: ...


class ResumeMetrics(Protocol):
    """What the lifecycle reports (runner.metrics.registry.RunnerMetrics fits)."""

    def checkpoint_failed(self, stage: str) -> None: ...

    def resumed(self, *, steps_lost: int = 0) -> None: ...

    def train_step(self, step: int) -> None: ...

    def checkpoint_found(self, *, location: str, step: int, created_at: float) -> None: ...


class FinalUploader(Protocol):
    def upload_now(self, ckpt: CommittedCheckpoint, *, deadline: float | None = None) -> bool: ...


# -- where to resume from ---------------------------------------------------------------------


@overload
def find_resume(
    run_dir: Path,
    *,
    stop: StopController,
    load: Callable[[Path, Manifest], T],
    mirror: ResumeSource | None = None,
    metrics: ResumeMetrics | None = None,
    fresh_start: bool = False,
    refusal_log_level: int = logging.WARNING,
) -> ResumePoint[T] | None: ...


@overload
def find_resume(
    run_dir: Path,
    *,
    stop: StopController,
    load: None = None,
    mirror: ResumeSource | None = None,
    metrics: ResumeMetrics | None = None,
    fresh_start: bool = False,
    refusal_log_level: int = logging.WARNING,
) -> ResumePoint[None] | None: ...


def find_resume(
    run_dir: Path,
    *,
    stop: StopController,
    load: Callable[[Path, Manifest], Any] | None = None,
    mirror: ResumeSource | None = None,
    metrics: ResumeMetrics | None = None,
    fresh_start: bool = False,
    refusal_log_level: int = logging.WARNING,
) -> ResumePoint[Any] | None:
    """The newest usable checkpoint of the run dir ∪ the mirror; None when there is none.

    Resume or refuse (runner.mirror.resume.choose_resume): checkpoints that exist with none
    usable raise UnusableCheckpointsError (exit 3) and are never replaced; `fresh_start` sets
    them aside and returns None. `load(step_dir, manifest)` takes a candidate once it verified
    (the session loads into its state, the supervisor passes None: verified is enough); a
    RunnerError from it refuses that checkpoint. Each refusal counts as a failed verify.

    Runs in a worker that a stop gives up on (runner.preemption.startup): StartupInterrupted
    then, and nothing was published in the run dir after the stop."""

    def on_skip(step: int, why: str) -> None:  # choose_resume has logged it
        if metrics is not None:
            metrics.checkpoint_failed("verify")

    def resolve() -> ResumePoint[Any] | None:
        if mirror is None:
            return choose_resume(
                run_dir,
                None,
                load=load,
                on_skip=on_skip,
                fresh_start=fresh_start,
                refusal_log_level=refusal_log_level,
            )
        return mirror.choose_resume(
            run_dir,
            load=load,
            on_skip=on_skip,
            fresh_start=fresh_start,
            refusal_log_level=refusal_log_level,
        )

    return run_interruptible(resolve, stop=stop, what="resume resolution")


# -- the resume report ------------------------------------------------------------------------


def steps_lost(loss_log: LossLog, resume_step: int) -> int:
    """Steps an earlier attempt logged in loss.jsonl past the step resumed from (0 when the
    trainer keeps no loss.jsonl)."""
    return max(0, max(loss_log.read(), default=0) - resume_step)


def report_resume(
    point: ResumePoint[Any] | None,
    *,
    run_dir: Path,
    loss_log: LossLog,
    metrics: ResumeMetrics | None,
    attempt: int = 1,
    history: Sequence[float] | None = None,
    counters: Counters | None = None,
    announce: bool = True,
    mark_from_scratch: bool = True,
    logger: logging.Logger = log,
) -> int:
    """Report where attempt number `attempt` continues from; returns the steps lost.
    The one resume report of both entry points, in this order: steps lost, the loss.jsonl
    marker and backfill, the metrics, the announcement.

    Steps logged past the resume point are superseded in loss.jsonl (a marker, for trainers
    that keep one without knowing the rule); `history` (the loss history the checkpoint
    carries) rebuilds the lines a fresh node lost with its disk. Metrics: a restart counts as
    a resume even from scratch, and the checkpoint found is reported for the first attempt.
    `counters`: the restored ones, whose step is where the run continues (a resume at another
    world size rescales the manifest's step); the manifest's otherwise. It decides the steps
    lost, the marker and the train_step metric. `announce` logs the outcome ("resumed from
    ..."; the supervisor says it its own way) under the caller's `logger` (the README shows
    TrainSession's lines as runner.session.train_session's). `mark_from_scratch`: a start
    without a checkpoint supersedes the steps logged before it (a supervisor's restart); a
    TrainSession passes False and leaves loss.jsonl alone then, as it always has."""
    step = point.step if point is not None else 0
    if point is not None and counters is not None:
        step = counters.step
    lost = steps_lost(loss_log, step)  # read before the marker supersedes those lines
    _update_loss_log(point, step, loss_log, history, mark_from_scratch=mark_from_scratch)
    if metrics is not None:
        _report_resume_metrics(metrics, point, step, lost=lost, attempt=attempt)
    if announce:
        _announce_resume(logger, point, step, lost=lost, run_dir=run_dir, counters=counters)
    return lost


def _update_loss_log(
    point: ResumePoint[Any] | None,
    step: int,
    loss_log: LossLog,
    history: Sequence[float] | None,
    *,
    mark_from_scratch: bool,
) -> None:
    """The marker that supersedes the lines past `step`, then the lines a fresh node lost."""
    if point is not None or mark_from_scratch:
        loss_log.mark_resume(step)
    if point is not None and history is not None:
        backfill_loss_log(loss_log, history, source=f"checkpoint step {point.step}")


def _report_resume_metrics(
    metrics: ResumeMetrics, point: ResumePoint[Any] | None, step: int, *, lost: int, attempt: int
) -> None:
    """A restart counts as a resume even from scratch; the checkpoint found is reported for
    the first attempt only."""
    if point is not None and attempt == 1:
        created = created_at_unix(point.manifest.created_at) or time.time()
        where = "remote" if point.checkpoint.store_uri is not None else "local"  # several nodes
        metrics.checkpoint_found(location=where, step=point.step, created_at=created)
    if point is not None or attempt > 1:
        metrics.resumed(steps_lost=lost)
    if point is not None:
        metrics.train_step(step)


def _announce_resume(
    logger: logging.Logger,
    point: ResumePoint[Any] | None,
    step: int,
    *,
    lost: int,
    run_dir: Path,
    counters: Counters | None,
) -> None:
    """The outcome under the caller's `logger`; the samples seen are the restored counters'
    when there are some (they are where the run continues), the manifest's otherwise."""
    if point is None:
        logger.info("no checkpoint to resume from in %s: starting at step 0", run_dir)
        return
    logger.info(
        "resumed from %s (step %d, %d samples seen%s)",
        _resumed_where(point),
        step,
        counters.samples_seen if counters is not None else point.manifest.samples_seen,
        f"; {lost} logged steps after it are redone" if lost else "",
    )


def _resumed_where(point: ResumePoint[Any]) -> str:
    if point.checkpoint.store_uri is None:
        return str(point.step_dir)
    if point.manifest.format == FORMAT_DCP:
        return "the mirror (each rank fetched the files it reads)"
    return "the mirror (each rank fetched it whole)"


def backfill_loss_log(loss_log: LossLog, history: Sequence[float], *, source: str) -> None:
    """On a fresh node loss.jsonl is gone with the old disk; the checkpoint carries the
    history that led to it, so the sidecar is rebuilt from there (lines marked as such)."""
    logged = loss_log.read()
    missing = [s for s in range(1, len(history) + 1) if s not in logged]
    for step in missing:
        loss_log.append(step, history[step - 1], restored_from=source)
    if missing:
        log.info("loss.jsonl: restored %d entries from the checkpoint", len(missing))


# -- the end ----------------------------------------------------------------------------------


def stop_deadline(stop: StopController, *, grace_seconds: float) -> float | None:
    """When a stop's work must be done (monotonic): the deadline a request carries (the
    earliest), else the grace period counted from when the first request arrived; None
    without a stop request."""
    requests = stop.requests
    if not requests:
        return None
    deadline = stop.deadline
    if deadline is not None:
        return deadline
    return min(r.at for r in requests) + grace_seconds


@dataclass(frozen=True, kw_only=True)
class Ending:
    exit_code: int
    landed: bool | None
    """Whether the final upload landed; None when none was attempted."""


def end_run(
    *,
    mirror: FinalUploader | None,
    ckpt: CommittedCheckpoint | None,
    stop: StopController,
    grace_seconds: float,
    stopped: bool,
    final: bool = True,
    stopped_without_final: int = EXIT_FAILURE,
) -> Ending:
    """Upload the final checkpoint `ckpt` (if any, to a mirror if there is one) and pick the
    exit code.

    The upload runs in the caller's time: whenever a stop was requested within
    `stop_deadline`, even when the run reached its target first (`stopped` False: the node is
    going away all the same); after a normal finish with no stop request, with no deadline (a
    large final upload on a slow link is not a failure).

    Exit 0 when the run finished and its final checkpoint is in the mirror (or there is no
    mirror or nothing to upload), 1 when that upload did not land (a scheduler retries); 75
    when stopped with a `final` checkpoint committed (or nothing trained, so nothing lost),
    else `stopped_without_final` (1, or the trainer's own 2 or 3 under `runner run`)."""
    landed: bool | None = None
    if mirror is not None and ckpt is not None:
        deadline = stop_deadline(stop, grace_seconds=grace_seconds)  # None without a stop
        landed = mirror.upload_now(ckpt, deadline=deadline)
    if stopped:
        code = EXIT_PREEMPTED if final else stopped_without_final
    else:
        code = EXIT_FAILURE if landed is False else EXIT_OK
    return Ending(exit_code=code, landed=landed)
