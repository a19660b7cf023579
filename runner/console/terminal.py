"""Log handlers and a line redrawn in place (the demo's progress line, transfer bars) on one
terminal: while such a line is live, the stream handlers writing to the same stream get a
wrapper that clears the line before each record and redraws it after, so a record always
starts at column 0. Nothing happens at import; callers wrap and unwrap explicitly."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TextIO

# (handler, the wrapper it now writes to): wrappers are duck-typed streams with `.inner`
Wrapped = list[tuple[logging.StreamHandler[Any], Any]]


def wrap_console_handlers(stream: TextIO, make: Callable[[TextIO], Any]) -> Wrapped:
    """Give every stream handler of the root and `runner` loggers that writes to `stream` (the
    same object or the same open file) the stream `make(its_stream)`. Returns what to pass to
    `unwrap_console_handlers`."""
    wrapped: Wrapped = []
    seen: set[int] = set()
    for handler in [*logging.getLogger().handlers, *logging.getLogger("runner").handlers]:
        if id(handler) in seen or not isinstance(handler, logging.StreamHandler):
            continue
        seen.add(id(handler))
        if isinstance(handler, logging.FileHandler) or not same_stream(handler.stream, stream):
            continue
        wrapper = make(handler.stream)
        handler.setStream(wrapper)
        wrapped.append((handler, wrapper))
    return wrapped


def unwrap_console_handlers(wrapped: Wrapped) -> None:
    """Give each handler its own stream back (unless something else replaced it since)."""
    for handler, wrapper in wrapped:
        inner = getattr(wrapper, "inner", None)
        if handler.stream is wrapper and inner is not None:
            handler.setStream(inner)
    wrapped.clear()


def same_stream(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return os.path.samestat(os.fstat(a.fileno()), os.fstat(b.fileno()))
    except (AttributeError, OSError, ValueError):
        return False
