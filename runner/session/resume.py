"""The session's side of resuming: the newest checkpoint found and read (not yet loaded into
the live objects), and the one resumed from made sure of in the mirror."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.manifest import created_at_unix
from runner.checkpoint.resume_point import ResumePoint
from runner.metrics.registry import RunnerMetrics
from runner.preemption.startup import run_interruptible
from runner.preemption.stop import StopController
from runner.runtime.lifecycle import find_resume, report_resume
from runner.session.checkpointer import Checkpointer
from runner.state.counters import Counters

if TYPE_CHECKING:
    from runner.mirror import Mirror

# the session's lines keep one logger name (tests/e2e/test_readme_example.py pins it)
log = logging.getLogger("runner.session.train_session")


def read_newest(
    run_dir: Path,
    *,
    stop: StopController,
    checkpointer: Checkpointer,
    mirror: Mirror | None,
    metrics: RunnerMetrics | None,
    fresh_start: bool,
    refusals_reported: bool,
) -> ResumePoint[dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads, from the run dir or the mirror, by
    the one resolver (runner.runtime.lifecycle.find_resume: resume or refuse, given up on
    by a stop: StartupInterrupted); None when there is none anywhere.

    Each file is hashed once, by the resolver while choosing among local and remote
    checkpoints (a download as it arrives); `Checkpointer.read` then re-checks paths and
    sizes and deserialises, in the resolver's worker: it touches no live object.
    `refusals_reported`: a supervisor already logged each refused checkpoint (debug here)."""
    return find_resume(
        run_dir,
        stop=stop,
        load=checkpointer.read,
        mirror=mirror,
        metrics=metrics,
        fresh_start=fresh_start,
        refusal_log_level=logging.DEBUG if refusals_reported else logging.WARNING,
    )


def keep_mirrored(
    point: ResumePoint[Any],
    *,
    mirror: Mirror,
    stop: StopController,
    metrics: RunnerMetrics | None,
) -> None:
    """The checkpoint resumed from is counted as found in the mirror, or submitted for
    upload when the mirror lacks it; StartupInterrupted when a stop gave up on the check."""
    held = run_interruptible(
        lambda: mirror.holds(point.step), stop=stop, what="checking the mirror's copy"
    )
    if held:
        if metrics is not None:
            created = created_at_unix(point.manifest.created_at) or time.time()
            metrics.checkpoint_found(location="remote", step=point.step, created_at=created)
        return
    # e.g. the previous attempt finished but could not upload: the local copy is the newest
    # anywhere, so it goes up now rather than never
    log.info("checkpoint step %d is not in the mirror yet: uploading it", point.step)
    mirror.submit(point.checkpoint)


def report_resumed(
    point: ResumePoint[Any],
    counters: Counters,
    *,
    run_dir: Path,
    history: list[float],
    steps: int | None,
    loss_log: LossLog,
    metrics: RunnerMetrics | None,
    announce: bool,
) -> None:
    """The lines and metrics of a resume from `point`, loaded as `counters`."""
    if steps is not None and counters.step > steps:
        log.warning(
            "the run is already at step %d, past --steps %d: nothing to train", counters.step, steps
        )
    resized = point.manifest.world_size != counters.world_size
    if resized:  # the history's index is no longer this run's step
        loss_log.follow_history(len(history))
    report_resume(
        point,
        run_dir=run_dir,
        loss_log=loss_log,
        metrics=metrics,
        # the history counts steps of the world size that wrote it: after a rescale its
        # indices are no step numbers of this run's loss.jsonl, so nothing is backfilled
        history=history if not resized else None,
        counters=counters,
        announce=announce,
        logger=log,
    )


def report_from_scratch(
    run_dir: Path, *, loss_log: LossLog, metrics: RunnerMetrics | None, announce: bool
) -> None:
    # loss.jsonl is left alone: a supervisor marks a restart from scratch before it
    report_resume(
        None,
        run_dir=run_dir,
        loss_log=loss_log,
        metrics=metrics,
        mark_from_scratch=False,
        announce=announce,
        logger=log,
    )
