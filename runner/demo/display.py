"""The demo's live progress line: step, loss, steps/s, last checkpoint and its age, and how
long the last checkpoint stalled training.

On a terminal the line is redrawn in place; otherwise (logs, CI) one line is printed every
`every_seconds` so a log stays readable. While the line is live, log handlers writing to the
same stream go through `_ClearingStream` (see runner/console/terminal.py), so a record printed
meanwhile (a checkpoint commit, a mirror warning) starts at column 0 and the progress line is
redrawn below it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from runner.console.terminal import Wrapped, unwrap_console_handlers, wrap_console_handlers

CLEAR_LINE = "\r\033[K"


class ProgressDisplay:
    def __init__(
        self,
        *,
        total_steps: int,
        stream: TextIO | None = None,
        live: bool | None = None,
        every_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_steps = total_steps
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self.every_seconds = every_seconds
        self.clock = clock
        self._rate_mark: tuple[float, int] | None = None
        self._rate = 0.0
        self._last_print = 0.0
        self._ckpt: tuple[int, float] | None = None
        self._stall: float | None = None
        # the progress text now on the stream's last line ("" when none): log records from
        # any thread clear and redraw it, so every write to the stream holds this lock
        self._drawn = ""
        self._lock = threading.Lock()
        self._wrapped: Wrapped = []
        if self.live:
            self._attach_to_logging()

    def checkpoint(self, step: int, *, age_seconds: float = 0.0) -> None:
        """A checkpoint was committed `age_seconds` ago. Call it once per commit, never per
        step: the age shown is how stale the newest checkpoint is, and only a new one may
        reset it."""
        self._ckpt = (step, self.clock() - max(0.0, age_seconds))

    def stall(self, seconds: float) -> None:
        """The last checkpoint blocked training `seconds` (async: the copy into host memory)."""
        self._stall = seconds

    def update(self, *, step: int, loss: float) -> None:
        now = self.clock()
        if self._rate_mark is None:
            self._rate_mark = (now, step)
        elif now - self._rate_mark[0] >= 1.0:
            then, then_step = self._rate_mark
            self._rate = (step - then_step) / (now - then)
            self._rate_mark = (now, step)
        if not self.live and now - self._last_print < self.every_seconds:
            return
        self._last_print = now
        ckpt = "none yet"
        if self._ckpt is not None:
            ckpt = f"step {self._ckpt[0]} ({now - self._ckpt[1]:.0f}s ago)"
        line = (
            f"step {step}/{self.total_steps}  loss {loss:.4f}  {self._rate:.1f} steps/s  "
            f"last checkpoint: {ckpt}"
        )
        if self._stall is not None:
            line += f"  stall {_duration(self._stall)}"
        with self._lock:
            if self.live:
                self.stream.write(CLEAR_LINE + line)
                self._drawn = line
            else:
                self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the live line (the cursor moves to a fresh line) and give the log handlers
        their own stream back."""
        with self._lock:
            if self._drawn:
                self.stream.write("\n")
                self.stream.flush()
            self._drawn = ""
        unwrap_console_handlers(self._wrapped)

    def _attach_to_logging(self) -> None:
        self._wrapped = wrap_console_handlers(
            self.stream, lambda inner: _ClearingStream(inner, self)
        )

    def _before_log_write(self, inner: TextIO) -> bool:
        """Called with the lock held: clear the progress line; True when one was drawn."""
        if not self._drawn:
            return False
        inner.write(CLEAR_LINE)
        return True

    def _after_log_write(self, inner: TextIO) -> None:
        inner.write(CLEAR_LINE + self._drawn)
        inner.flush()


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1.0 else f"{seconds:.1f} s"


class _ClearingStream:
    """A log handler's stream while the progress line is live: each record is written on a
    cleared line, then the progress line is drawn again under it."""

    def __init__(self, inner: TextIO, display: ProgressDisplay) -> None:
        self.inner = inner
        self._display = display

    def write(self, text: str) -> int:
        display = self._display
        with display._lock:
            redraw = display._before_log_write(self.inner)
            written = self.inner.write(text)
            if redraw and text.endswith("\n"):
                display._after_log_write(self.inner)
            elif redraw:
                display._drawn = ""  # a partial line now ends the stream: do not overwrite it
            return written

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self.inner, name)
