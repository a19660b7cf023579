"""What the session says at its end: how a stop ended, a finish whose final checkpoint did
not reach the mirror, a start-up a stop gave up on, a save that could not be written."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import CheckpointWriteError
from runner.preemption.startup import StartupInterrupted

if TYPE_CHECKING:
    from runner.mirror import Mirror

# the session's lines keep one logger name (tests/e2e/test_readme_example.py pins it)
log = logging.getLogger("runner.session.train_session")


def report_stop(
    ckpt: CommittedCheckpoint | None,
    *,
    reason: str | None,
    step: int,
    elapsed: float,
    grace_seconds: float,
    where: str,
) -> None:
    """The stop's last line: where its final checkpoint is durable (`where`), or that there
    was nothing to save."""
    if ckpt is None:
        # 75 all the same: nothing was trained, so nothing was lost (docs/preemption.md)
        log.warning(
            "stopped by %s at step %d before anything was trained: no checkpoint to "
            "write, nothing lost",
            reason,
            step,
        )
        return
    log.warning(
        "stopped by %s at step %d: final checkpoint durable in %s after %.2fs "
        "of the %.0fs grace period",
        reason,
        step,
        where,
        elapsed,
        grace_seconds,
    )


def report_left_by_exit(
    ckpt: CommittedCheckpoint | None, *, reason: str | None, step: int, ckpt_dir: Path
) -> None:
    """A `with TrainSession` block left by SystemExit (no code, or 0) after a stop was
    requested, e.g. by a framework's own SIGTERM handler (PyTorch Lightning's
    SIGTERMException): the run did not finish (exit 0 would tell the orchestrator the job is
    done), and no final checkpoint was written (the optimizer may have stepped after the
    last step_done())."""
    stands = (
        f"checkpoint step {ckpt.step} ({ckpt.path}) stands"
        if ckpt is not None
        else f"no checkpoint stands in {ckpt_dir}"
    )
    log.error(
        "the training loop was left by SystemExit after a stop (%s) at step %d, not through "
        "session.should_stop: no final checkpoint was written (the session cannot tell whether "
        "the optimizer stepped after the last step_done()); %s. Exiting 1, not 0: the run did "
        "not finish. If a framework raised it on SIGTERM (PyTorch Lightning's "
        "SIGTERMException), leave SIGTERM to spot-runner",
        reason,
        step,
        stands,
    )


def durable_where(
    ckpt: CommittedCheckpoint | None,
    *,
    startup_given_up: bool,
    mirror: object | None,
    landed: bool | None,
) -> str:
    """Where a stop's final checkpoint is: local, and the mirror when its upload landed; the
    mirror alone for one the ranks of several nodes committed there."""
    if ckpt is not None and ckpt.store_uri is not None:
        return "the mirror (committed there by the ranks of every node)"
    if startup_given_up:
        return "local (mirror not contacted: start-up was given up on)"
    if mirror is None:
        return "local"
    return "local + mirror" if landed else "local only (mirror upload did NOT land)"


def report_not_mirrored(ckpt: CommittedCheckpoint, *, mirror: Mirror, run_dir: Path) -> None:
    log.error(
        "the run finished at step %d but its final checkpoint is NOT in %s (%s); the "
        "local copy in %s is complete: `runner push %s %s` once the store is "
        "reachable. Exiting 1 so that a scheduler retries",
        ckpt.step,
        mirror.storage.uri,
        mirror.last_error or "upload failed",
        ckpt.path,
        run_dir,
        mirror.storage.uri,
    )


def report_startup_given_up(
    exc: StartupInterrupted, *, resumed_from: int | None, ckpt_dir: Path
) -> None:
    where = (
        f"checkpoint step {resumed_from} stands in {ckpt_dir}"
        if resumed_from is not None
        else f"checkpoints in {ckpt_dir} (if any) are as they were"
    )
    log.warning("%s; nothing trained, %s", exc, where)


def write_error(
    exc: OSError, *, step: int, ckpt_dir: Path, previous: int | None
) -> CheckpointWriteError:
    """The error of a save that failed before its commit, with advice for its OSError."""
    from runner.checkpoint.oserror_advice import oserror_advice

    kept = f"step {previous} is intact" if previous is not None else "none existed yet"
    return CheckpointWriteError(
        f"checkpoint at step {step} could not be written to {ckpt_dir}: "
        f"{exc.strerror or exc}; the previous checkpoint: {kept}. {oserror_advice(exc)}"
    )
