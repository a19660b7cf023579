"""Retry policy for object-storage calls: exponential backoff with full jitter on transient
failures only, inside a time budget. Callers classify errors into the project's types first;
the policy looks at types, never at messages.

Time limits of one call (docs/storage.md, "Time limits"):
- `budget_s`: the call gives up once the store has been failing for this long, counted from
  the call's start or from the last byte it moved (a large transfer that makes progress is
  never cut short by the budget).
- a deadline set with `store_deadline()` (e.g. the stop's deadline): no wait runs past it
  and no further try starts after it.
A try is started only if its worst case (`try_worst_s`, from the client's timeouts) fits
before the limit; the first try always runs, so a call ends within max(limit, one try).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from runner.errors import ConfigError, StorageTimeoutError, StorageTransientError

log = logging.getLogger(__name__)

T = TypeVar("T")

# A monotonic instant no store call of this thread/context waits past (None: no deadline).
_DEADLINE: ContextVar[float | None] = ContextVar("store_deadline", default=None)


@contextlib.contextmanager
def store_deadline(deadline: float | None) -> Iterator[None]:
    """Within the block, store calls made by this thread never wait past `deadline` (a
    time.monotonic() instant) nor start a retry after it; an outer, earlier deadline stays."""
    outer = _DEADLINE.get()
    if deadline is None or (outer is not None and outer <= deadline):
        yield
        return
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def current_deadline() -> float | None:
    """The deadline `store_deadline` set for this thread's store calls (None: none)."""
    return _DEADLINE.get()


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    attempts: int = 5
    """Total tries of one operation, the first included."""
    initial_wait_s: float = 0.5
    """Scale of the first backoff; each later one may be up to twice as long."""
    max_wait_s: float = 20.0
    """Upper bound of one backoff."""
    budget_s: float | None = None
    """Give up once the store has failed for this long (None: only `attempts` bounds it)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"retry attempts must be >= 1 (got {self.attempts})")
        if self.initial_wait_s < 0 or self.max_wait_s < 0:
            raise ConfigError("retry waits must be >= 0")
        if self.budget_s is not None and self.budget_s <= 0:
            raise ConfigError(f"store time budget must be > 0 (got {self.budget_s})")

    def call(
        self,
        what: str,
        func: Callable[[], T],
        *,
        try_worst_s: float = 0.0,
        last_progress: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> T:
        """Run func, retrying StorageTransientError; anything else propagates at once. When
        the budget or deadline leaves no room for another try, StorageTimeoutError says so.
        Long: one retry loop, with each give-up message (tries spent, time spent) where it is
        decided."""
        started = clock()
        attempt = 0
        while True:
            attempt += 1
            try:
                return func()
            except StorageTransientError as exc:
                now = clock()
                if attempt >= self.attempts:
                    # same type, and the message says why and for how long it was tried
                    within = (
                        ""
                        if self.budget_s is None
                        else f" within the store timeout {self.budget_s:g} s"
                    )
                    raise type(exc)(
                        f"{what}: gave up after {now - started:.1f} s and {attempt} "
                        f"tr{'y' if attempt == 1 else 'ies'} (all {self.attempts} tries "
                        f"failed{within}); last error: {exc}"
                    ) from exc
                wait = random.uniform(
                    0, min(self.max_wait_s, self.initial_wait_s * 2 ** (attempt - 1))
                )
                limit, why = self._limit(started, last_progress)
                if limit is not None:
                    room = limit - now - try_worst_s
                    if room < 0:
                        raise StorageTimeoutError(
                            f"{what}: gave up after {now - started:.1f} s and {attempt} "
                            f"tr{'y' if attempt == 1 else 'ies'} ({why}); last error: {exc}"
                        ) from exc
                    wait = min(wait, room)
                log.warning(
                    "%s failed (try %d of %d): %s; retrying in %.1fs",
                    what,
                    attempt,
                    self.attempts,
                    exc,
                    wait,
                )
                sleep(wait)

    def _limit(
        self, started: float, last_progress: Callable[[], float | None] | None
    ) -> tuple[float | None, str]:
        """The instant no try may run past, and why, from the budget and the deadline."""
        limits: list[tuple[float, str]] = []
        if self.budget_s is not None:
            since = started
            moved = last_progress() if last_progress is not None else None
            if moved is not None:
                since = max(since, moved)
            limits.append(
                (
                    since + self.budget_s,
                    f"store timeout {self.budget_s:g} s; raise --store-timeout "
                    "(RUNNER_STORE_TIMEOUT) if the store is only slow",
                )
            )
        deadline = _DEADLINE.get()
        if deadline is not None:
            limits.append((deadline, "the stop deadline"))
        if not limits:
            return None, ""
        return min(limits)
