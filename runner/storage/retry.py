"""Retry policy for object-storage calls: exponential backoff with full jitter on transient
failures only. Callers classify errors into the project's types first; the policy looks at
types, never at messages."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from runner.errors import ConfigError, StorageTransientError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    attempts: int = 5
    """Total tries of one operation, the first included."""
    initial_wait_s: float = 0.5
    """Scale of the first backoff; each later one may be up to twice as long."""
    max_wait_s: float = 20.0
    """Upper bound of one backoff."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"retry attempts must be >= 1 (got {self.attempts})")
        if self.initial_wait_s < 0 or self.max_wait_s < 0:
            raise ConfigError("retry waits must be >= 0")

    def call(self, what: str, func: Callable[[], T]) -> T:
        """Run func, retrying StorageTransientError; anything else propagates at once."""

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            wait = state.next_action.sleep if state.next_action else 0.0
            log.warning(
                "%s failed (try %d of %d): %s; retrying in %.1fs",
                what,
                state.attempt_number,
                self.attempts,
                exc,
                wait,
            )

        retrying = Retrying(
            retry=retry_if_exception_type(StorageTransientError),
            stop=stop_after_attempt(self.attempts),
            wait=wait_random_exponential(multiplier=self.initial_wait_s, max=self.max_wait_s),
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(func)
