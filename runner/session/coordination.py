"""How the ranks of one run agree (runner.collective.Group): first on their settings, then on
each step's decision, on the checkpoint they resume from, and on the run's length.

The settings that must be equal on every rank (`shared_settings`) are all-gathered once, at
start, before any checkpoint is read or written: every rank sees the same lists and so
reaches the same verdict, and all of them exit 2 together instead of training apart (a
rank's files in another run dir, a rank waiting at a collective the others never reach).

Each step ends with one small all-reduce (MAX) of three flags: a stop seen by this rank
(SIGTERM/SIGINT to it, a notice its node polled), a checkpoint request (SIGUSR1 to it), and
a save due by the seconds cadence (decided on rank 0 alone: wall clocks differ). So every rank
stops or saves after the same step whichever rank saw the request; a signal that arrives
after a step's agreement counts at the next step. benchmarks/distributed.py measures it
against the other mechanisms (a c10d store key, an all-reduce every k steps).

The resume is resolved on global rank 0 (it verifies every file once, downloads from the
mirror into the shared run dir) and its outcome broadcast; every rank then loads the chosen
checkpoint itself. A refusal on rank 0 is raised on every rank with the same exit code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from runner.checkpoint.manifest import Manifest
from runner.checkpoint.resume_point import ResumePoint
from runner.checkpoint.writer import CommittedCheckpoint
from runner.collective.failures import RankFailure
from runner.collective.group import Group
from runner.collective.step import Step
from runner.config import RunConfig
from runner.errors import EXIT_PREEMPTED, ConfigError, RunnerError, StartupInterrupted
from runner.preemption.policy import REASON_SECONDS, SavePolicy
from runner.preemption.stop import StopController

log = logging.getLogger(__name__)

T = TypeVar("T")

PEER_STOP = "stop requested on another rank"
PEER_CHECKPOINT = "checkpoint requested on another rank"

RUN_DIR_OPTION = "--run-dir"


def agree_on_settings(
    group: Group,
    config: RunConfig,
    *,
    node: int,
    job_settings: Mapping[str, object] | None = None,
) -> None:
    """COLLECTIVE: every rank's `settings_of` gathered; ConfigError (exit 2) on every rank
    alike when any setting differs (`refuse_differing`)."""
    if not group.single:
        refuse_differing(group.all_gather(settings_of(config, node=node, job=job_settings)))


def settings_of(
    config: RunConfig, *, node: int, job: Mapping[str, object] | None = None
) -> tuple[int, dict[str, object]]:
    """What a rank brings to the comparison: its node, the run's settings every rank must be
    given alike (`shared_settings`) and the caller's own (`job`, option -> value)."""
    return node, {**shared_settings(config), **(job or {})}


def refuse_differing(gathered: Sequence[tuple[int, Mapping[str, object]]]) -> None:
    """ConfigError naming, one line per setting, each rank's value of every setting that
    differs between the ranks' `settings_of` (indexed by rank); the run dir only among the
    ranks of one node. Every rank gets the same list, so all reach the same verdict."""
    names = list(dict.fromkeys(name for _, theirs in gathered for name in theirs))
    lines = []
    for name in names:
        if name == RUN_DIR_OPTION:  # among the ranks of each node: each node has its own
            for n in sorted({n for n, _ in gathered}):
                ranks = [r for r, (theirs, _) in enumerate(gathered) if theirs == n]
                line = _differs(name, gathered, ranks, f"the ranks of node {n}")
                lines += [line] if line else []
        elif line := _differs(name, gathered, range(len(gathered)), "ranks"):
            lines.append(line)
    if lines:
        raise ConfigError(
            "the ranks of this job were not given the same settings:\n"
            + "".join(f"  {line}\n" for line in lines)
            + "give every rank the same options (torchrun passes its command's to all of "
            "them; a wrapper must not change them per rank, e.g. with $LOCAL_RANK): the ranks "
            "of one node share one --run-dir, each node has its own. No checkpoint was read "
            "or written"
        )


def shared_settings(config: RunConfig) -> dict[str, object]:
    """The run's settings every rank must be given alike, by option name. The run dir is
    among them (resolved: one directory by two names is the same), compared only among the
    ranks of one node."""
    return {
        RUN_DIR_OPTION: str(config.run_dir.resolve()),
        "--mirror": config.mirror,
        "--steps": config.steps,
        "--seed": config.seed,
        "--ckpt-every": config.ckpt_every,
        "--ckpt-every-seconds": "auto"
        if config.ckpt_every_seconds_auto
        else config.ckpt_every_seconds,
        "--keep": config.keep,
        "--save-mode": config.save_mode,
    }


def _differs(
    name: str,
    gathered: Sequence[tuple[int, Mapping[str, object]]],
    ranks: Sequence[int],
    among: str,
) -> str | None:
    values = {r: gathered[r][1].get(name, "(not given)") for r in ranks}
    if len({repr(v) for v in values.values()}) < 2:
        return None
    shown = ", ".join(f"rank {r}: {'none' if v is None else v}" for r, v in values.items())
    return f"{name} differs between {among}: {shown}"


@dataclass(frozen=True)
class StepDecision:
    stop: bool
    save_reason: str | None


def agree_on_step(
    group: Group,
    *,
    stop: StopController,
    policy: SavePolicy,
    step: int,
    grace_seconds: float,
    clock: Callable[[], float],
) -> StepDecision:
    """The ranks' common decision after `step`: stop, save (and why, as this rank sees it)."""
    asked = stop.take_checkpoint_request()
    due = policy.due(step)
    stopping, checkpoint, saving = group.agree(
        (int(stop.stop_requested), int(asked is not None), int(due is not None))
    )
    if stopping and not stop.stop_requested:
        # this rank's own deadline, from now: the same grace its own SIGTERM would give
        stop.request_stop(PEER_STOP, deadline=clock() + grace_seconds)
    reason = asked or due
    if reason is None and (checkpoint or saving):
        # the seconds cadence is the only one decided on one rank
        reason = PEER_CHECKPOINT if checkpoint else REASON_SECONDS
    return StepDecision(stop=bool(stopping), save_reason=None if stopping else reason)


def resolve_on_primary(
    group: Group,
    resolve: Callable[[], ResumePoint[T] | None],
    read: Callable[[Path, Manifest], T],
) -> ResumePoint[T] | None:
    """Rank 0's resume point, on every rank: rank 0 runs `resolve`, the others `read` the
    checkpoint it chose. What rank 0 raises (a refusal, start-up given up) is raised there and
    re-raised on the others as a RunnerError with the same exit code."""
    point: ResumePoint[T] | None = None

    def choose() -> tuple[CommittedCheckpoint, bool] | None:
        nonlocal point
        point = resolve()
        return None if point is None else (point.checkpoint, point.from_mirror)

    chosen = decided_on_primary(group, choose)
    if group.rank == 0 or chosen is None:
        return point
    checkpoint, from_mirror = chosen  # the one result type, as rank 0 found it
    return ResumePoint(
        checkpoint=checkpoint,
        loaded=read(checkpoint.path, checkpoint.manifest),
        from_mirror=from_mirror,
    )


def decided_on_primary(group: Group, decide: Callable[[], T]) -> T:
    """Rank 0's `decide()`, broadcast to every rank (which must all call this at the same
    point: a decision step, runner.collective.step). What rank 0 raises is raised there and
    re-raised on the others as a RunnerError with the same exit code (StartupInterrupted for
    a stop that gave start-up up)."""
    return Step(group, fail=_refused, own=(Exception,)).decide(decide)


def _refused(failures: list[RankFailure], rank: int) -> RunnerError:
    """Rank 0's refusal to resume (or giving up), as this rank raises it."""
    (told,) = failures
    if told.exit_code == EXIT_PREEMPTED:
        return StartupInterrupted(f"rank 0: {told.what}")
    return _PeerRefusal(told.what, told.exit_code)


class _PeerRefusal(RunnerError):
    """Rank 0 refused to resume (or gave up): the same outcome on this rank."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(f"rank 0: {message}")
        self.exit_code = exit_code


def target_samples(
    *,
    steps: int | None,
    global_batch: int | None,
    resumed: Manifest | None,
) -> int | None:
    """The run's length in samples, fixed when it started: carried by its checkpoints
    (manifest extra `target_samples`), or `steps` x this run's global batch for a run that
    starts now or whose checkpoints predate it (then they were written at one world size, so
    their samples per step is the global batch they ran with). None without a step target
    or a known global batch."""
    carried = resumed.extra.get("target_samples") if resumed is not None else None
    if resumed is not None and isinstance(carried, int):
        was = resumed.extra.get("target_steps")
        if steps is not None and isinstance(was, int) and was > 0 and steps != was:
            # --steps changed: the same global batch of the first attempt, another length
            changed = carried // was * steps
            log.warning(
                "--steps %d, not %d as when the run's length was fixed: its length is now %d "
                "samples (was %d)",
                steps,
                was,
                changed,
                carried,
            )
            return changed
        return carried
    if steps is None:
        return None
    if resumed is not None and resumed.step > 0 and resumed.samples_seen > 0:
        return steps * (resumed.samples_seen // resumed.step)
    return steps * global_batch if global_batch else None
