"""`log_to_stderr`: show the runner's own log lines (resume, checkpoint commits, mirror
warnings) when it is used in-process from a user's script.

The `runner` CLI configures logging itself; a script using `TrainSession` has no handler on
the `runner` loggers, so Python shows only warnings without a format, and nothing at INFO.
Importing this module changes nothing: only the call attaches a handler.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as `runner` prints them

_MARK = "_spot_runner_stderr"


def log_to_stderr(
    level: int | str = logging.INFO, *, stream: TextIO | None = None
) -> logging.Handler:
    """Print records of the `runner` loggers at `level` and above to stderr (or `stream`),
    one line each, and return the handler (``logging.getLogger("runner").removeHandler(h)``
    undoes it). Calling it again replaces the previous handler rather than adding a second.

    Only the `runner` logger is touched, never the root logger: the rest of the script's
    logging is left as it is. If the script configures the root logger too, records also
    reach it (they propagate), so use one or the other."""
    logger = logging.getLogger("runner")
    for old in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        logger.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _MARK, True)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
