"""Each trainer start as an attempt (runner.goodput.records): the supervisor writes what it
sees (the start, its search for the checkpoint, the spawn, a stop it forwarded, the exit) and
copies the record to the mirror at the attempt's end; a runner child appends the rest to the
same file (RUNNER_ATTEMPT_ID). The supervisor's own lifetime is not an attempt."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from runner.goodput.account import account
from runner.goodput.history import (
    copy_at_exit,
    in_background,
    local_records,
    pull_records,
)
from runner.goodput.records import AttemptLog, new_attempt_id
from runner.supervisor.ending import last_logged_step
from runner.supervisor.hooks import MetricsHook, MirrorHook

ENV_ATTEMPT_ID = "RUNNER_ATTEMPT_ID"
REFRESH_SECONDS = 10.0


class SupervisedAttempts:
    def __init__(
        self, run_dir: Path, *, mirror: MirrorHook | None, metrics: MetricsHook | None
    ) -> None:
        self.run_dir = run_dir
        self.mirror = mirror
        self.metrics = metrics
        self.current: AttemptLog | None = None
        self._ended = True
        self._began_at = 0.0
        self._resolve: tuple[float, float, int] | None = None
        self._refreshed = 0.0
        self._refreshed_size = -1

    def pull_history(self) -> None:
        """A new node goes on counting the attempts before it: copied down in the background
        (nothing waits for the store), the metrics updated once they are in."""
        mirror = self.mirror
        if mirror is None:
            self.update_metrics()
            return

        def pull() -> None:
            pull_records(mirror.storage, self.run_dir)
            self.update_metrics()

        in_background(pull, what="copying the attempt records down from the mirror")

    def begin(self) -> AttemptLog:
        """A new attempt, written from its spawn on: a start refused before the trainer ran
        (exit 2 or 3, or a stop) is no attempt and leaves the run dir as it found it."""
        self.current = AttemptLog(self.run_dir, new_attempt_id(), on_failure=self._failed)
        self._began_at = time.time()
        self._resolve = None
        self._ended = True  # nothing to end until the spawn
        return self.current

    def env(self) -> dict[str, str]:
        return {ENV_ATTEMPT_ID: self.current.attempt_id} if self.current is not None else {}

    def resolved(self, *, seconds: float, step: int | None) -> None:
        self._resolve = (time.time(), seconds, step or 0)

    def spawned(self, *, step: int | None) -> None:
        """The trainer started: the attempt's start, the search for its checkpoint, and the
        spawn (where a trainer writes no `ready` of its own, its training counts from here)."""
        current = self.current
        if current is None:
            return
        self._ended = False
        current.event(
            "start",
            t=self._began_at,
            host=os.environ.get("HOSTNAME") or socket.gethostname(),
            pid=os.getpid(),
            world_size=None,
        )
        if self._resolve is not None:
            at, seconds, resumed = self._resolve
            current.event("resolve", t=at, seconds=round(seconds, 3), step=resumed)
        current.event("spawn", step=step or 0)
        if self.mirror is not None:
            self.mirror.attach_record(current.path, current.key)

    def stop_forwarded(self, reason: str | None) -> None:
        if self.current is not None:
            self.current.event("stop", reason=reason or "stop", notice=True)

    def end(self, *, exit_code: int, fallback_step: int | None, deadline: float | None) -> None:
        """The attempt's end (once), then its record copied to the mirror within the
        deadline's time left (at most UPLOAD_SECONDS)."""
        current = self.current
        if current is None or self._ended:
            return
        self._ended = True
        last = last_logged_step(self.run_dir)
        current.event(
            "end", exit_code=exit_code, last_step=last if last is not None else fallback_step
        )
        self.update_metrics()
        mirror = self.mirror
        if mirror is None:
            return
        if not copy_at_exit(mirror.put_record, current.key, current.path, deadline=deadline):
            self._failed()

    def refresh(self) -> None:
        """While a trainer runs (each scan): the metrics again once its record grew, at most
        every REFRESH_SECONDS (a runner child's metrics port is the supervisor's)."""
        current = self.current
        if current is None or self.metrics is None or self._ended:
            return
        now = time.monotonic()
        if now - self._refreshed < REFRESH_SECONDS:
            return
        self._refreshed = now
        try:
            size = current.path.stat().st_size
        except OSError:
            return
        if size != self._refreshed_size:
            self._refreshed_size = size
            self.update_metrics()

    def update_metrics(self) -> None:
        if self.metrics is None:
            return
        try:
            result = account(local_records(self.run_dir))
        except (OSError, ValueError):
            return
        self.metrics.goodput(ratio=result.goodput_ratio, badput=result.badput_seconds)

    def _failed(self) -> None:
        if self.metrics is not None:
            self.metrics.checkpoint_failed("attempts")
