"""When to save: every N steps, every T seconds, whichever comes first.

Step saves land on multiples of N (step 100, 200, ...), so they line up with audits that run
on the same cadence even after an out-of-cadence save (SIGUSR1, a resume). The seconds clock
restarts at every save, whatever triggered it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runner.config import RunConfig
from runner.errors import ConfigError

REASON_STEPS = "steps"
REASON_SECONDS = "seconds"


class SavePolicy:
    def __init__(
        self,
        *,
        every_steps: int | None,
        every_seconds: float | None,
        clock: Callable[[], float] = time.monotonic,
        start_step: int = 0,
    ) -> None:
        if every_steps is not None and every_steps < 0:
            raise ConfigError(f"checkpoint every N steps needs N >= 0 (got {every_steps})")
        if every_seconds is not None and every_seconds <= 0:
            raise ConfigError(f"checkpoint every T seconds needs T > 0 (got {every_seconds})")
        self.every_steps = every_steps or None  # 0 disables, like None
        self.every_seconds = every_seconds
        self._clock = clock
        self._last_step = start_step
        self._last_time = clock()

    @classmethod
    def of_run(cls, config: RunConfig, *, primary: bool, start: int = 0) -> SavePolicy:
        """The run's cadence from `start`. The seconds cadence is the primary's alone (wall
        clocks differ between ranks): the others learn its decision in the step's agreement
        (runner.session.coordination)."""
        return cls(
            every_steps=config.ckpt_every,
            every_seconds=config.ckpt_every_seconds if primary else None,
            start_step=start,
        )

    @property
    def last_saved_step(self) -> int:
        return self._last_step

    def due(self, step: int) -> str | None:
        """Why a checkpoint is due after `step` completed updates, or None."""
        if step <= self._last_step:
            return None  # this state is already saved (or older than the last save)
        if self.every_steps is not None and step % self.every_steps == 0:
            return REASON_STEPS
        if self.every_seconds is not None and self._clock() - self._last_time >= self.every_seconds:
            return REASON_SECONDS
        return None

    def saved(self, step: int) -> None:
        """Record a save at `step` (any reason); restarts the seconds clock."""
        self._last_step = step
        self._last_time = self._clock()

    def seconds_until_due(self) -> float | None:
        """Seconds until the time cadence fires (<= 0: due), None without one."""
        if self.every_seconds is None:
            return None
        return self.every_seconds - (self._clock() - self._last_time)
