"""Transfer progress bars: on stderr, only on a terminal, only for transfers that last more
than a few seconds (tqdm's `delay`), so logs and pipes stay clean."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm

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

        yield advance
