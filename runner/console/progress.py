"""Transfer progress bars: on stderr, only on a terminal, only for transfers that last more
than a few seconds (tqdm's `delay`), so logs and pipes stay clean. While a bar is on the
terminal, log records written to the same stream clear it first and redraw it after (see
runner/console/terminal.py), so a retry warning never lands glued onto the bar."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

from runner.console.terminal import unwrap_console_handlers, wrap_console_handlers
from runner.storage.base import ProgressCallback

SHOW_AFTER_S = 3.0


@contextmanager
def transfer_progress(
    total: int,
    *,
    desc: str,
    stream: TextIO | None = None,
    show_after_s: float = SHOW_AFTER_S,
) -> Iterator[ProgressCallback]:
    """A byte-count callback (safe to call from transfer threads) feeding one bar."""
    out = stream if stream is not None else sys.stderr
    lock = threading.Lock()
    with tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        delay=show_after_s,
        file=out,
        disable=not out.isatty(),
        leave=False,
        dynamic_ncols=True,
    ) as bar:

        def advance(count: int) -> None:
            with lock:
                bar.update(count)

        wrapped = (
            [] if bar.disable else wrap_console_handlers(out, lambda s: _BarSafe(s, bar, lock))
        )
        try:
            yield advance
        finally:
            unwrap_console_handlers(wrapped)


class _BarSafe:
    """A log handler's stream while a bar may be on the terminal."""

    def __init__(self, inner: TextIO, bar: tqdm[Any], lock: threading.Lock) -> None:
        self.inner = inner
        self._bar = bar
        self._lock = lock

    def write(self, text: str) -> int:
        with self._lock:
            # tqdm's default timer is time.time; before `delay` has passed nothing is drawn
            shown = time.time() - self._bar.start_t >= self._bar.delay
            if shown:
                self._bar.clear()
            written = self.inner.write(text)
            if shown and text.endswith("\n"):
                self._bar.refresh()
            return written

    def flush(self) -> None:
        self.inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
