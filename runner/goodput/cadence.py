"""`--ckpt-every-seconds auto`: the checkpoint interval chosen from measurement.

Young's interval √(2·C·M) minimises the expected time lost to checkpoints plus redone work,
where
- C is the cost of one checkpoint to training: sync, the whole save (the loop waits for it);
  async, the stall plus how much longer the steps took while the background save persisted
  (the same steps timed against those with no save in flight);
- M is the mean time between failures *without* a final checkpoint, from the run's own
  attempt records: a preemption with notice loses nothing, so it does not count. With the
  prior `--mtbf` as one pseudo-observation, M = (prior + seconds run) / (1 + failures): the
  prior alone at first, the run's own rate more and more as it runs and fails
  (seconds throughout).
The interval is never shorter than one background save (a save would start while the last
one is still persisting) and is re-evaluated at each checkpoint.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

FIRST_COST_SECONDS = 1.0
"""C before the first checkpoint was measured (the first interval only)."""
MIN_INTERVAL_SECONDS = 1.0
_SMOOTHING = 0.5  # weight of the newest checkpoint's cost in the running estimate


@dataclass(frozen=True)
class Choice:
    interval: float
    cost: float
    stall: float
    slowdown: float
    mtbf: float
    failures: int
    hours_run: float

    def describe(self) -> str:
        return (
            f"checkpoint interval {self.interval:.1f} s (auto, √(2·C·M): C {self.cost:.3f} s "
            f"per checkpoint = stall {self.stall:.3f} s + slower steps {self.slowdown:.3f} s; "
            f"M {self.mtbf:.0f} s from {self.failures} failure(s) without notice in "
            f"{self.hours_run:.2f} h run and the --mtbf prior)"
        )


def young_interval(cost: float, mtbf: float) -> float:
    return math.sqrt(2.0 * max(cost, 0.0) * max(mtbf, 0.0))


def observed_mtbf(prior: float, *, seconds_run: float, failures: int) -> float:
    """The prior as one pseudo-observation, then the run's own failures."""
    return (prior + max(seconds_run, 0.0)) / (1 + max(failures, 0))


class AutoCadence:
    """Times the steps and each checkpoint's cost; chooses the interval after each."""

    def __init__(self, *, mtbf_prior: float) -> None:
        # steps are timed on the loop's thread, a background save's commit on the saver's
        self._lock = threading.Lock()
        self.mtbf_prior = mtbf_prior
        self.cost: float | None = None
        self.choice: Choice | None = None
        self._free_step: float | None = None  # mean step with no save in flight (EMA)
        self._busy_time = 0.0  # steps while the newest save persisted: their time and count
        self._busy_steps = 0
        self._last_background = 0.0

    @property
    def interval(self) -> float:
        if self.choice is not None:
            return self.choice.interval
        return max(young_interval(FIRST_COST_SECONDS, self.mtbf_prior), MIN_INTERVAL_SECONDS)

    def step(self, seconds: float, *, saving: bool) -> None:
        """One step took `seconds` of loop time (the checkpoint's stall taken out)."""
        if seconds <= 0:
            return
        with self._lock:
            self._step(seconds, saving=saving)

    def _step(self, seconds: float, *, saving: bool) -> None:
        if saving:
            self._busy_time += seconds
            self._busy_steps += 1
        elif self._free_step is None:
            self._free_step = seconds
        else:
            self._free_step += 0.1 * (seconds - self._free_step)

    def checkpointed(
        self,
        *,
        stall: float,
        background: float | None,
        seconds_run: float,
        failures: int,
    ) -> Choice:
        """At a commit: this save's stall, and for a background one the extra time of the
        steps trained while it persisted, make C."""
        with self._lock:
            return self._checkpointed(
                stall=stall, background=background, seconds_run=seconds_run, failures=failures
            )

    def _checkpointed(
        self, *, stall: float, background: float | None, seconds_run: float, failures: int
    ) -> Choice:
        slowdown = 0.0
        if self._busy_steps and self._free_step is not None:
            slowdown = max(0.0, self._busy_time - self._busy_steps * self._free_step)
        self._busy_time, self._busy_steps = 0.0, 0
        cost = max(stall, 0.0) + slowdown
        self.cost = cost if self.cost is None else self.cost + _SMOOTHING * (cost - self.cost)
        if background is not None:
            self._last_background = background
        mtbf = observed_mtbf(self.mtbf_prior, seconds_run=seconds_run, failures=failures)
        interval = max(young_interval(self.cost, mtbf), self._last_background, MIN_INTERVAL_SECONDS)
        self.choice = Choice(
            interval=interval,
            cost=self.cost,
            stall=stall,
            slowdown=slowdown,
            mtbf=mtbf,
            failures=failures,
            hours_run=seconds_run / 3600,
        )
        return self.choice
