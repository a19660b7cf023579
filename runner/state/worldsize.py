"""Resuming under a different world size (number of data-parallel ranks).

A step is one optimizer update over a global batch of ``batch_size * world_size`` samples, so a
step count means different amounts of data at different world sizes. The seeds' rule is to
rescale it: ``new_step = step * old_ws // new_ws`` (floor: never claim more updates than the data
seen supports). ``samples_seen`` does not depend on the world size and is carried unchanged; the
data position is recomputed from it (or taken from the sampler's offset, which is counted in
samples too). The LR schedule, a function of the step, is moved to the rescaled step.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.errors import ConfigError

if TYPE_CHECKING:
    from runner.state.counters import Counters

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldSizeChange:
    """What a resume at another world size changed, for the log and for callers."""

    old_world_size: int
    new_world_size: int
    old_step: int
    new_step: int
    samples_seen: int

    def describe(self) -> str:
        scaled = self.old_step * self.old_world_size
        exact = (
            ""
            if scaled % self.new_world_size == 0
            else f", floor of {scaled / self.new_world_size:g}"
        )
        return (
            f"world size changed {self.old_world_size} -> {self.new_world_size}: step rescaled "
            f"{self.old_step} -> {self.new_step} (step x {self.old_world_size} / "
            f"{self.new_world_size}{exact}); samples_seen {self.samples_seen} kept exactly"
        )


def rescale_step(step: int, *, old_world_size: int, new_world_size: int) -> int:
    """``step * old_ws // new_ws``; raises ConfigError for a world size below 1."""
    if old_world_size < 1 or new_world_size < 1:
        raise ConfigError(
            f"world sizes must be >= 1, got saved={old_world_size} current={new_world_size}"
        )
    return step * old_world_size // new_world_size


def rescale_counters(
    counters: Counters, *, new_world_size: int
) -> tuple[Counters, WorldSizeChange | None]:
    """Counters for this world size, and the change made (None when the size is unchanged).

    The epoch and batch-in-epoch are left to the caller, who knows the data position (see
    `position_from_samples_seen` and `ResumableSampler.load_state_dict`).
    """
    if counters.world_size == new_world_size:
        return counters, None
    new_step = rescale_step(
        counters.step, old_world_size=counters.world_size, new_world_size=new_world_size
    )
    change = WorldSizeChange(
        old_world_size=counters.world_size,
        new_world_size=new_world_size,
        old_step=counters.step,
        new_step=new_step,
        samples_seen=counters.samples_seen,
    )
    log.warning("%s", change.describe())
    return dataclasses.replace(counters, step=new_step, world_size=new_world_size), change


def position_from_samples_seen(
    samples_seen: int, *, num_samples: int, global_batch_size: int
) -> tuple[int, int]:
    """(epoch, sample offset in that epoch) after `samples_seen` samples at a constant global batch.

    Each epoch uses ``num_samples // global_batch_size`` whole global batches (the tail is
    dropped), so this is exact for a run that kept one global batch size up to that point; use
    it when a checkpoint carries no sampler position (a seed ``.bin`` file).
    """
    if global_batch_size < 1 or num_samples < global_batch_size:
        raise ConfigError(
            f"cannot place {samples_seen} samples: global batch {global_batch_size} does not fit "
            f"a dataset of {num_samples}"
        )
    per_epoch = num_samples // global_batch_size * global_batch_size
    return samples_seen // per_epoch, samples_seen % per_epoch


def move_scheduler_to_step(scheduler: Any, *, step: int) -> list[float]:
    """Re-evaluate an LR scheduler at `step` (exact for closed-form schedules such as LambdaLR);
    returns the learning rates it gives there.

    Chainable schedulers (StepLR, ...) compute from the previous LR; for them this is an
    approximation, which is why the caller logs the move (`announce_schedule_move`), once per
    resume, with the value the run goes on with.
    """
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():
        # step() outside the usual optimizer.step() order warns; here it is deliberate.
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    return [float(lr) for lr in scheduler.get_last_lr()]


def announce_schedule_move(step: int, lrs: list[float], *, why: str = "") -> None:
    """The one line a resume at another world size logs about its LR schedule."""
    log.warning("LR schedule moved to step %d%s: lr=%s", step, why, lrs)
