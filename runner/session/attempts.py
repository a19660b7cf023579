"""The session's attempt record (runner.goodput.records): what this process writes, when, and
the goodput metrics recomputed from the whole run's records at each checkpoint.

Alone (`runner demo`, a script), the session writes the attempt's `start` and `end` itself;
under `runner run` (RUNNER_ATTEMPT_ID set) the supervisor writes them and mirrors the file,
and the session appends what only it knows: the restore, each checkpoint, progress, the stop.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from runner.config import RunConfig
from runner.goodput.account import Goodput, account
from runner.goodput.cadence import FIRST_COST_SECONDS, AutoCadence
from runner.goodput.history import (
    copy_at_exit,
    in_background,
    local_records,
    pull_records,
)
from runner.goodput.records import AttemptLog, new_attempt_id, process_started_at
from runner.metrics.registry import RunnerMetrics
from runner.runtime.rank import RankContext

if TYPE_CHECKING:
    from runner.mirror import Mirror

log = logging.getLogger(__name__)


class SessionAttempt:
    """One process's attempt record, written by the primary only."""

    def __init__(
        self,
        config: RunConfig,
        *,
        rank: RankContext,
        metrics: RunnerMetrics | None,
        mirror: Mirror | None,
    ) -> None:
        self.run_dir = Path(config.run_dir)
        self.supervised = config.attempt_id is not None
        self.metrics = metrics
        self.mirror = mirror
        self.primary = rank.acts_as_primary
        self.log = AttemptLog(
            self.run_dir,
            config.attempt_id or new_attempt_id(),
            writes=self.primary,
            on_failure=self._failed,
        )
        self._stopped = False
        self._world_size = rank.world_size
        # --ckpt-every-seconds auto: the interval chosen by the primary at each checkpoint
        self.cadence = (
            AutoCadence(mtbf_prior=config.mtbf)
            if config.ckpt_every_seconds_auto and self.primary
            else None
        )
        self._step_began: float | None = None
        self._stall_since_step = 0.0
        self._last_stall = 0.0
        self._was_saving = False
        if self.cadence is not None:
            log.info(
                "checkpoint interval %.1f s (auto, until the first checkpoint is measured: "
                "C taken as %.1f s, M the --mtbf prior %.0f s)",
                self.cadence.interval,
                FIRST_COST_SECONDS,
                config.mtbf,
            )
        if metrics is not None and self.primary:
            every = self.cadence.interval if self.cadence else config.ckpt_every_seconds
            if every is not None:
                metrics.checkpoint_interval(every)
        if self.primary and mirror is not None:  # copied up after each checkpoint upload
            mirror.attach_record(self.log.path, self.log.key)

    def _begin(self) -> None:
        """Alone, the attempt's `start` (at the process's start), written once the restore is
        done: a start that is refused (exit 2 or 3) leaves the run dir as it found it."""
        if self.supervised or not self.primary:
            return
        mirror = self.mirror
        if mirror is not None:  # a new node goes on counting the run's earlier attempts

            def pull() -> None:
                pull_records(mirror.storage, self.run_dir)
                self.update_metrics()

            in_background(pull, what="copying the attempt records down from the mirror")
        self.log.event(
            "start",
            t=process_started_at(),
            host=os.environ.get("HOSTNAME") or socket.gethostname(),
            pid=os.getpid(),
            world_size=self._world_size,
        )

    def _failed(self) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint_failed("attempts")

    def ready(self, *, seconds: float, step: int, world_size: int) -> None:
        self._begin()
        self.log.ready(seconds=seconds, step=step, world_size=world_size)
        self.update_metrics()

    @property
    def interval(self) -> float | None:
        """The seconds cadence `auto` chose (None without `auto`)."""
        return self.cadence.interval if self.cadence is not None else None

    def saved(self, *, step: int, stall_seconds: float) -> None:
        """On the loop, once a save let it go on (sync: committed; async: copied)."""
        self.log.save(step=step, stall_seconds=stall_seconds)
        self._stall_since_step += stall_seconds  # inside the next step's time: not the step's
        self._last_stall = stall_seconds

    def committed(
        self,
        *,
        step: int,
        samples: int,
        reason: str,
        seconds: float,
        background_seconds: float | None,
    ) -> None:
        """The save of `step` committed (a background one on the saver's thread)."""
        self.log.checkpoint(
            step=step, samples=samples, reason=reason, background_seconds=background_seconds
        )
        result = self.update_metrics()
        if self.cadence is None or result is None or reason in ("final", "stop"):
            return
        run = sum(a.ended_at - a.started_at for a in result.attempts)
        # this attempt has no end yet: it is running, not failed
        failures = sum(
            1
            for a in result.attempts
            if a.end == "failed" and not a.notice and a.attempt != self.log.attempt_id
        )
        # sync: the loop waited for the whole save (committed before the loop went on)
        stall = seconds if background_seconds is None else self._last_stall
        choice = self.cadence.checkpointed(
            stall=stall,
            background=background_seconds,
            seconds_run=run,
            failures=failures,
        )
        log.info("%s", choice.describe())
        if self.metrics is not None:
            self.metrics.checkpoint_interval(choice.interval)

    def step(self, step: int, *, saving: bool) -> None:
        """At each step boundary: the progress event, and for `auto` the step's loop time
        (busy when a background save was in flight at its start or its end)."""
        self.log.step(step)
        if self.cadence is None:
            return
        now = time.monotonic()
        if self._step_began is not None:
            took = now - self._step_began - self._stall_since_step
            self.cadence.step(took, saving=saving or self._was_saving)
        self._step_began = now
        self._stall_since_step = 0.0
        self._was_saving = saving

    def stopped(self, reason: str | None) -> None:
        if not self._stopped:
            self._stopped = True
            self.log.event("stop", reason=reason or "stop", notice=True)

    def ended(self, *, exit_code: int, last_step: int, deadline: float | None) -> None:
        """Alone: the `end` event, then the record copied up within what is left of the
        stop's deadline (at most UPLOAD_SECONDS). Under a supervisor it does both."""
        if self.supervised or not self.primary:
            return
        self.log.event("end", exit_code=exit_code, last_step=last_step)
        self.update_metrics()
        mirror = self.mirror
        if mirror is None:
            return
        if not copy_at_exit(mirror.put_record, self.log.key, self.log.path, deadline=deadline):
            self._failed()

    def update_metrics(self) -> Goodput | None:
        """The goodput gauges from every record in the run dir (this attempt's included);
        the account, for the cadence."""
        if (self.metrics is None and self.cadence is None) or not self.primary:
            return None
        try:
            result = account(local_records(self.run_dir))
        except (OSError, ValueError) as exc:
            log.warning("goodput metrics not updated: %s", exc)
            return None
        if self.metrics is not None:
            self.metrics.goodput(ratio=result.goodput_ratio, badput=result.badput_seconds)
        return result
