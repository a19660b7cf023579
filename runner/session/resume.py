"""The session's side of resuming: the newest checkpoint found and read (not yet loaded into
the live objects), and the one resumed from made sure of in the mirror."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.checkpoint.manifest import created_at_unix
from runner.metrics.registry import RunnerMetrics
from runner.preemption.startup import run_interruptible
from runner.preemption.stop import StopController
from runner.runtime.lifecycle import ResumePoint, find_resume
from runner.session.checkpointer import Checkpointer

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
