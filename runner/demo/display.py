"""The demo's live progress line: step, loss, steps/s, last checkpoint and its age.

On a terminal the line is redrawn in place; otherwise (logs, CI) one line is printed every
`every_seconds` so a log stays readable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


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

    def checkpoint(self, step: int, *, age_seconds: float = 0.0) -> None:
        """A checkpoint was committed `age_seconds` ago. Call it once per commit, never per
        step: the age shown is how stale the newest checkpoint is, and only a new one may
        reset it."""
        self._ckpt = (step, self.clock() - max(0.0, age_seconds))

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
        if self.live:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()
