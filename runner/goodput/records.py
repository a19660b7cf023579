"""Attempt records: `RUN_DIR/attempts/<attempt-id>.jsonl`, one JSON event per line.

An attempt is one start of the training process (under `runner run`, each start of the child:
the supervisor writes its `start`, `resolve` and `end`, the child appends the rest to the same
file, named by RUNNER_ATTEMPT_ID). Events, each with "event" and "t" (UNIX time):

    start       host, pid, world_size (None when the writer cannot know it)
    resolve     seconds, step (the supervisor's search for the checkpoint to resume)
    spawn       step      (the supervisor started the trainer)
    ready       seconds (the restore), step (resumed from; 0 from scratch), world_size
    save        step, stall_seconds (the loop blocked), steps_per_second (since the previous
                save or the restore), written on the loop when it goes on
    checkpoint  step, samples, reason, background_seconds: the save committed (a background
                one later, off the loop)
    progress    step      (at most every PROGRESS_SECONDS: what a SIGKILL would lose)
    stop        reason, notice (True: a signal or a cloud notice asked for the stop)
    end         exit_code, last_step

Only the primary rank writes. A few hundred bytes per checkpoint; writing never raises and
never blocks training for long (one small append): a failed append is counted through
`on_failure`, like the loss log's, and the event is dropped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.checkpoint.layout import ATTEMPTS_DIR

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 30.0
"""How often a `progress` event is written at most: the steps a kill without notice loses
are known to within this much training."""

SUFFIX = ".jsonl"


def new_attempt_id(now: float | None = None) -> str:
    """Sortable by start time, unique across nodes: `20261206T115100Z-host-1234-ab12`."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    host = (os.environ.get("HOSTNAME") or socket.gethostname() or "host").replace("/", "_")
    return f"{stamp}-{host}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def process_started_at() -> float:
    """This process's start (UNIX time), so that `startup` counts the interpreter and its
    imports; now where /proc cannot tell."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22, counted after the command's ")"
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class AttemptLog:
    """The events of one attempt, appended to its file (see the module docstring)."""

    def __init__(
        self,
        run_dir: Path,
        attempt_id: str,
        *,
        writes: bool = True,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self.attempt_id = attempt_id
        self.path = Path(run_dir) / ATTEMPTS_DIR / f"{attempt_id}{SUFFIX}"
        self.key = f"{ATTEMPTS_DIR}/{attempt_id}{SUFFIX}"
        self.writes = writes
        self._on_failure = on_failure
        self.failures = 0
        # the newest (t, step) for the step rate since it
        self._last_point: tuple[float, int] | None = None
        self._last_progress = time.monotonic()

    def event(self, kind: str, *, t: float | None = None, **fields: Any) -> None:
        """Append one event; never raises (a failure is counted and the event dropped)."""
        if not self.writes:
            return
        record = {"event": kind, "t": round(time.time() if t is None else t, 3), **fields}
        try:
            line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, line)  # one write of a short line: appends do not interleave
            finally:
                os.close(fd)
        except (OSError, TypeError, ValueError) as exc:
            self.failures += 1
            if self.failures == 1:
                log.warning("attempt record %s: %s; goodput will miss events", self.path, exc)
            if self._on_failure is not None:
                self._on_failure()

    # -- the events a training loop writes -------------------------------------------------------
    def ready(self, *, seconds: float, step: int, world_size: int) -> None:
        self._last_point = (time.time(), step)
        self.event("ready", seconds=round(seconds, 3), step=step, world_size=world_size)

    def save(self, *, step: int, stall_seconds: float) -> None:
        """The loop goes on after saving `step`, blocked `stall_seconds` by it."""
        now = time.time()
        rate = None
        if self._last_point is not None:
            t0, step0 = self._last_point
            trained = now - t0 - stall_seconds
            if trained > 0 and step > step0:
                rate = round((step - step0) / trained, 4)
        self._last_point = (now, step)
        self.event(
            "save",
            t=now,
            step=step,
            stall_seconds=_rounded(stall_seconds),
            steps_per_second=rate,
        )

    def checkpoint(
        self, *, step: int, samples: int, reason: str, background_seconds: float | None
    ) -> None:
        self.event(
            "checkpoint",
            step=step,
            samples=samples,
            reason=reason,
            background_seconds=_rounded(background_seconds),
        )

    def step(self, step: int) -> None:
        """At every step boundary: a `progress` event at most every PROGRESS_SECONDS."""
        now = time.monotonic()
        if self.writes and now - self._last_progress >= PROGRESS_SECONDS:
            self._last_progress = now
            self.event("progress", step=step)

    def read_bytes(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except OSError:
            return None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
