"""The restart loop: a crashed attempt is retried with exponential backoff up to
`max_restarts`, then the give-up report shows each attempt's last output."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from runner.errors import EXIT_USAGE
from runner.supervisor.child import AttemptOutput, describe_exit

# the supervisor's lines keep the one logger name they have always had
log = logging.getLogger("runner.supervisor.supervise")


class ChildCrashed(Exception):
    """One trainer run ended badly; tenacity decides whether to restart."""

    def __init__(self, code: int) -> None:
        super().__init__(describe_exit(code))
        self.code = code


def restart_loop(
    attempt: Callable[[], int],
    *,
    max_restarts: int,
    backoff: float,
    max_backoff: float,
    wait: Callable[[float], object],
) -> int:
    """`attempt()`'s exit code; an attempt that raised ChildCrashed is run again after a
    backoff spent in `wait(seconds)`, until `max_restarts` restarts are used up (then the
    last ChildCrashed is raised)."""

    def sleep(seconds: float) -> None:
        wait(seconds)

    def log_restart(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        log.warning(
            "trainer failed (%s); restart %d of %d in %.2f s",
            exc,
            state.attempt_number,
            max_restarts,
            delay,
        )

    retrying = Retrying(
        stop=stop_after_attempt(max_restarts + 1),
        wait=wait_exponential(multiplier=backoff, max=max_backoff),
        retry=retry_if_exception_type(ChildCrashed),
        sleep=sleep,
        before_sleep=log_restart,
        reraise=True,
    )
    return retrying(attempt)


def give_up_message(
    command: Sequence[str],
    crash: ChildCrashed,
    *,
    attempts: int,
    max_restarts: int,
    ckpt_dir: Path,
    outputs: Iterable[AttemptOutput],
) -> str:
    return (
        f"the trainer `{' '.join(command)}` failed {attempts} time(s), last with "
        f"{crash}; gave up after --max-restarts {max_restarts}. Fix the trainer (or raise "
        f"--max-restarts); checkpoints so far are kept in {ckpt_dir}. "
        f"{output_report(outputs)}"
    )


def refusal_message(
    command: Sequence[str], code: int, *, ckpt_dir: Path, outputs: Iterable[AttemptOutput]
) -> str:
    what = "a usage or configuration error" if code == EXIT_USAGE else "an integrity failure"
    return (
        f"the trainer `{' '.join(command)}` exited {code} ({what}): not restarted, "
        f"it would fail the same way. Fix its command or inputs; checkpoints so far are "
        f"kept in {ckpt_dir}. {output_report(outputs)}"
    )


def output_report(outputs: Iterable[AttemptOutput]) -> str:
    """Each attempt's last lines under a header of its own, stdout and stderr in the
    order they were read."""
    shown = list(outputs)
    first = shown[0].attempt if shown else 1
    hidden = f" (attempts 1 to {first - 1} not shown)" if first > 1 else ""
    lines = [line for output in shown for line in output.render()]
    return f"Its last output, attempt by attempt{hidden}:\n" + "\n".join(lines)
