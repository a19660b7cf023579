"""The end of an attempt: which checkpoint stands, its final upload and the exit code.

After a normal finish, 0 only when the newest checkpoint is in the mirror
(`finish_mirrored`); after a stop we forwarded, 75 only when a final checkpoint stands
(`judge_stop`, then `finish_stopped`). Both end through runner.runtime.lifecycle.end_run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from runner.checkpoint.layout import parse_step_dir
from runner.checkpoint.listing import read_manifest_dir
from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.newest import Progress, newest_first
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import (
    EXIT_FAILURE,
    EXIT_INTEGRITY,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_USAGE,
    RunnerError,
)
from runner.preemption.stop import StopController
from runner.runtime.lifecycle import end_run, stop_deadline
from runner.supervisor.child import describe_exit
from runner.supervisor.hooks import MirrorHook

# the supervisor's lines keep the one logger name they have always had
log = logging.getLogger("runner.supervisor.supervise")


def finish_mirrored(
    newest: CommittedCheckpoint | None,
    *,
    mirror: MirrorHook | None,
    stop: StopController,
    grace_seconds: float,
    run_dir: Path,
    nothing_stands: str = "",
) -> int:
    """After a successful run, 0 only when the newest checkpoint is in the mirror; else 1,
    so a scheduler retries: also when no checkpoint was committed at all (`nothing_stands`
    says what the trainer left instead). `upload_now` finds an already uploaded checkpoint in
    place (one request) and otherwise tries once more in the caller's time."""
    if mirror is None:
        return EXIT_OK
    if newest is None:
        log.error(
            "the trainer finished but committed no checkpoint, so none is in the mirror %s; "
            "%s. Exiting 1: with --mirror, exit 0 means the final checkpoint is in the mirror",
            mirror.storage.uri,
            nothing_stands or "nothing stands",
        )
        return EXIT_FAILURE
    # no deadline on a normal finish: a large checkpoint on a slow link is not a failure;
    # a stop that arrived meanwhile bounds the wait, as it bounds end_run's upload
    deadline = stop_deadline(stop, grace_seconds=grace_seconds)
    mirror.wait_idle(None if deadline is None else max(0.0, deadline - time.monotonic()))
    ending = end_run(
        mirror=mirror, ckpt=newest, stop=stop, grace_seconds=grace_seconds, stopped=False
    )
    if ending.exit_code == EXIT_OK:
        return EXIT_OK
    log.error(
        "the trainer finished but checkpoint step %d is NOT in the mirror (errors above); "
        "the local copy in %s is complete: `runner push %s MIRROR` once the store is "
        "reachable. Exiting 1 so that a scheduler retries",
        newest.step,
        newest.path,
        run_dir,
    )
    return ending.exit_code


@dataclass(frozen=True)
class StopJudgement:
    """What stands after a stop we forwarded (see `judge_stop`)."""

    ckpt: CommittedCheckpoint | None  # the newest committed checkpoint
    fresh: bool  # committed during this stop
    final: bool  # it is the trainer's final checkpoint: the stop exits 75
    logged: int | None  # the newest step in the trainer's loss.jsonl
    lost_steps: bool  # loss.jsonl logs steps past it


def judge_stop(
    ckpt: CommittedCheckpoint | None,
    *,
    step_at_stop: int | None,
    samples_at_stop: int = 0,
    code: int,
    killed: bool,
    logged: int | None,
    unadopted_steps: Iterable[int],
    mute_exit: bool = False,
    exit_says_saved: bool = True,
) -> StopJudgement:
    """A final checkpoint is the newest committed one when

    - it was committed during this stop (newer by progress than `step_at_stop` and its
      `samples_at_stop`, runner/checkpoint/newest.py: every checkpoint committed or seed
      file waiting to be adopted when the stop was forwarded: a seed trainer's adopted .bin,
      or a checkpoint dir a runner child committed; a lower step with more samples, a run
      re-based at more ranks, is fresh), or
    - the trainer exited 0 or 75 on its own (not killed at the deadline): its state at the
      stop was already committed, e.g. a runner child stopped right after a save. With
      `mute_exit` the code tells nothing (torchrun's 1 after a stop it passed on, whatever
      its workers did): then the trainer's loss.jsonl must say it, logging no step past the
      checkpoint (ranks stopped while resuming, nothing trained); a trainer without one is
      not taken as stopped cleanly;

    Without `exit_says_saved` (a trainer whose own checkpoints are adopted, --adopt: HF exits
    0 after SIGTERM whether it saved or not) only a checkpoint committed during the stop, or
    a loss.jsonl logging no step past it, is final;

    and, in both cases, the trainer's loss.jsonl (`logged`, when it keeps one) logs no step
    past it and no seed file of a later step was left unadopted (then the supervisor exits 3).
    """
    at_stop = None if step_at_stop is None else Progress(step_at_stop, samples_at_stop)
    fresh = ckpt is not None and Progress.of(ckpt).newer_than(at_stop)
    clean = not killed and _stopped_cleanly(
        code, logged=logged, mute_exit=mute_exit, exit_says_saved=exit_says_saved
    )
    lost_steps = ckpt is not None and logged is not None and logged > ckpt.step
    # a newer file of the trainer's that was not adopted: its final one was lost
    rejected = ckpt is not None and any(step >= ckpt.step for step in unadopted_steps)
    final = ckpt is not None and (fresh or clean) and not lost_steps and not rejected
    return StopJudgement(ckpt=ckpt, fresh=fresh, final=final, logged=logged, lost_steps=lost_steps)


def _stopped_cleanly(
    code: int, *, logged: int | None, mute_exit: bool, exit_says_saved: bool
) -> bool:
    """Did the trainer, not killed, say that its state at the stop was already committed:
    by its exit code (0 or 75), or, when that says nothing, by its loss.jsonl?"""
    if exit_says_saved and code in (EXIT_OK, EXIT_PREEMPTED):
        return True
    return (mute_exit or not exit_says_saved) and logged is not None


def finish_stopped(
    judged: StopJudgement,
    *,
    code: int,
    killed: bool,
    took: float,
    mirror: MirrorHook | None,
    stop: StopController,
    grace_seconds: float,
    ckpt_dir: Path,
    nothing_stands: str = "the next start begins from scratch",
) -> int:
    """After a stop we forwarded: 75 only when a final checkpoint stands, else 1 (2 or 3
    when the trainer exited so); the standing checkpoint is uploaded within the stop's
    deadline (runner.runtime.lifecycle.stop_deadline). `took`: seconds from the forwarded
    stop to the trainer's exit; `nothing_stands`: what to say when no checkpoint does."""
    ckpt, final = judged.ckpt, judged.final
    _log_judgement(
        judged,
        code=code,
        killed=killed,
        took=took,
        grace=grace_seconds,
        ckpt_dir=ckpt_dir,
        nothing_stands=nothing_stands,
    )
    ending = end_run(
        mirror=mirror,
        ckpt=ckpt,
        stop=stop,
        grace_seconds=grace_seconds,
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
    if stop.stop_count > 1:
        log.info("%d stop requests received; the first one decided", stop.stop_count)
    if ending.exit_code != EXIT_PREEMPTED:
        log.error(
            "exiting %d, not 75: no final checkpoint was committed for this stop",
            ending.exit_code,
        )
    return ending.exit_code


def _log_judgement(
    judged: StopJudgement,
    *,
    code: int,
    killed: bool,
    took: float,
    grace: float,
    ckpt_dir: Path,
    nothing_stands: str,
) -> None:
    how = "killed at the end of the grace period" if killed else describe_exit(code)
    ckpt = judged.ckpt
    if ckpt is None:
        log.error(
            "trainer stopped (%s) without committing any checkpoint: none stands in %s; %s",
            how,
            ckpt_dir,
            nothing_stands,
        )
    elif judged.final:
        log.warning(
            "trainer stopped (%s) %.2f s after the stop signal (grace %.0f s); "
            "%s checkpoint: step %d",
            how,
            took,
            grace,
            "final" if judged.fresh else "final (already committed before the stop)",
            ckpt.step,
        )
    else:
        lost = judged.lost_steps
        past = f"; steps up to {judged.logged} it logged after it are lost" if lost else ""
        log.error(
            "trainer stopped (%s) %.2f s after the stop signal (grace %.0f s) without "
            "committing a final checkpoint; the checkpoint that stands is step %d in %s, "
            "committed %s%s",
            how,
            took,
            grace,
            ckpt.step,
            ckpt.path,
            "during the stop" if judged.fresh else "before the stop",
            past,
        )


def newest_committed(ckpt_dir: Path) -> CommittedCheckpoint | None:
    """The newest checkpoint directory by progress (runner/checkpoint/newest.py) with a
    valid manifest (committed; not hashed here: resume verifies it). A directory the trainer
    set aside since it was listed (the older copy of a re-based state) is passed over."""
    try:
        entries = list(ckpt_dir.iterdir())
    except OSError:
        return None
    found: dict[int, tuple[Path, Manifest]] = {}
    for entry in entries:
        step = parse_step_dir(entry.name)
        if step is None:
            continue
        try:
            found[step] = (entry, read_manifest_dir(entry))
        except (OSError, RunnerError, ValueError):
            continue
    for step in newest_first({step: manifest for step, (_, manifest) in found.items()}):
        step_dir, manifest = found[step]
        if step_dir.is_dir():
            return CommittedCheckpoint(step=step, path=step_dir, manifest=manifest)
    return None


def last_logged_step(run_dir: Path) -> int | None:
    """The newest step in the trainer's loss.jsonl, None when it keeps none."""
    try:
        logged = LossLog(run_dir).read()
    except (OSError, RunnerError, ValueError):
        return None
    return max(logged, default=None)
