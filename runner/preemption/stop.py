"""The stop request shared by signal handlers, notice pollers and the training loop.

Everything a signal handler calls here only appends to a list and writes one byte to a
non-blocking pipe. No lock is taken: a Python signal handler runs in the main thread between
two bytecodes, possibly while that thread holds a lock (for example inside
`threading.Event.set`), so a handler that takes a lock can deadlock the process. Appending to a
list is atomic under the GIL, which is all the handler-side needs; readers derive the current
answer (first reason by arrival time, earliest deadline) from the requests recorded so far.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopRequest:
    reason: str
    deadline: float | None
    """`time.monotonic()` instant by which the final checkpoint must be durable."""
    at: float


class StopController:
    """Thread- and signal-safe record of "stop" and "checkpoint now" requests.

    `request_stop` keeps the first reason and the earliest deadline of all requests; repeated
    requests (a second SIGTERM during the final save) are recorded and change nothing else.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Append-only; never rebound or cleared, so concurrent appenders cannot lose an entry.
        self._stops: list[StopRequest] = []
        self._checkpoints: list[str] = []
        self._checkpoints_taken = 0  # only the consuming thread touches this
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False

    # -- called from signal handlers and other threads -------------------------------------
    def request_stop(
        self, reason: str, *, deadline: float | None = None, at: float | None = None
    ) -> None:
        """Ask the loop to stop at the next step boundary. `deadline` is monotonic-based;
        `at` is when the request really arrived (a signal recorded before this controller
        existed), default now."""
        self._stops.append(StopRequest(reason, deadline, self._clock() if at is None else at))
        self._wake()

    def request_checkpoint(self, reason: str) -> None:
        """Ask for a checkpoint at the next step boundary, training continues (SIGUSR1)."""
        self._checkpoints.append(reason)
        self._wake()

    def _wake(self) -> None:
        # A full pipe already wakes the waiter; a closed one means nobody waits any more.
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # -- read side ---------------------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        return bool(self._stops)

    @property
    def reason(self) -> str | None:
        """Reason of the first stop request to arrive (the one that decided the stop). By
        arrival time, not by order of recording: a replayed early signal may be recorded
        after one that came later (ties: the one recorded first)."""
        stops = list(self._stops)
        return min(stops, key=lambda r: r.at).reason if stops else None

    @property
    def deadline(self) -> float | None:
        """Earliest deadline of every stop request so far (monotonic), None if none had one."""
        deadlines = [r.deadline for r in list(self._stops) if r.deadline is not None]
        return min(deadlines, default=None)

    @property
    def stop_count(self) -> int:
        """How many stop requests arrived (2+ means e.g. a repeated SIGTERM was ignored)."""
        return len(self._stops)

    @property
    def requests(self) -> list[StopRequest]:
        return list(self._stops)

    def time_left(self) -> float | None:
        """Seconds until the deadline (negative when past), None without a deadline."""
        deadline = self.deadline
        return None if deadline is None else deadline - self._clock()

    def take_checkpoint_request(self) -> str | None:
        """Consume pending checkpoint requests; returns the newest reason, or None.

        Several SIGUSR1 between two step boundaries collapse into one checkpoint.
        """
        pending = len(self._checkpoints)
        if pending == self._checkpoints_taken:
            return None
        self._checkpoints_taken = pending
        return self._checkpoints[pending - 1]

    @property
    def checkpoint_pending(self) -> bool:
        return len(self._checkpoints) > self._checkpoints_taken

    def wait(self, timeout: float | None) -> bool:
        """Block until a stop is requested or `timeout` seconds pass; returns stop_requested."""
        return self._wait(timeout, lambda: self.stop_requested)

    def wait_any(self, timeout: float | None) -> bool:
        """Like `wait`, but also returns early (True) on a pending checkpoint request."""
        return self._wait(timeout, lambda: self.stop_requested or self.checkpoint_pending)

    def _wait(self, timeout: float | None, done: Callable[[], bool]) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not done():
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            if self._closed:
                time.sleep(min(remaining or 0.05, 0.05))
                continue
            readable, _, _ = select.select([self._wake_r], [], [], remaining)
            if readable:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.read(self._wake_r, 4096)
        return done()

    def close(self) -> None:
        """Release the wake-up pipe. Requests still work afterwards; `wait` then polls."""
        if not self._closed:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
