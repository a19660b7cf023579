"""The one collective step of the ranks' protocols: local work on every rank, a decision on
the primary (global rank 0), the outcome on all, and every failure raised alike on every rank.

    every rank  `local()`: its value, or what went wrong on it (never raised out early: the
                others would wait for it until the timeout)
    all_gather  every rank's value or failure, on every rank
    rank 0      `decide(values)` when no rank failed; the outcome is broadcast
    every rank  the outcome, or the one error `fail` builds from the list of failures

`decide` alone is rank 0's decision (one broadcast); `gather` alone is every rank's value,
or the error on all; `run` is both. The commit of several ranks
(runner.checkpoint.ranked, runner.mirror.nodes), the multi-node load
(runner.mirror.node_resume) and the resume point chosen on rank 0
(runner.session.coordination) are built of these steps.

What a rank raises: the caller's `fail(failures, rank)`, the same error on every rank naming
each rank that failed (" (this one)" on that rank), chained from the rank's own exception;
rank 0's own exception in a decision, of a type in `own`, is raised there as it is (its type
is what its caller acts on: a refusal's exit code, a full disk). An exception that is not
an Exception (KeyboardInterrupt, SystemExit) is told to the others, then raised as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

from runner.collective.failures import RankFailure
from runner.collective.group import Group
from runner.errors import EXIT_FAILURE, IntegrityError, RunnerError, StorageTransientError

L = TypeVar("L")
T = TypeVar("T")

Fail = Callable[[list[RankFailure], int], BaseException]
"""(every failure, in rank order; this rank) -> the error this rank raises."""


def kind_of(exc: BaseException) -> str:
    """The kind a RankFailure records: a store failure worth retrying, a file that did not
    verify, or anything else."""
    if isinstance(exc, StorageTransientError):
        return "transient"
    if isinstance(exc, IntegrityError):
        return "integrity"
    return "other"


def failure_of(exc: BaseException, *, rank: int, what: str = "") -> RankFailure:
    """`exc` as every rank is told it: `what` (the work that failed) before its text."""
    said = str(exc) or type(exc).__name__
    text = f"{what}: {said}" if what else said
    code = exc.exit_code if isinstance(exc, RunnerError) else EXIT_FAILURE
    return RankFailure(rank, text, kind_of(exc), exit_code=code)


@dataclass(frozen=True)
class Step:
    """One protocol's collective steps, all raising the same way (module docstring). Every
    rank calls the same steps in the same order."""

    group: Group
    fail: Fail
    own: tuple[type[BaseException], ...] = ()
    """Rank 0's own exceptions of these types, from a decision, are raised there as they are
    (a rank's failure in its local work is always raised as the error of all)."""

    def run(
        self,
        local: Callable[[], L],
        decide: Callable[[list[L]], T],
        *,
        what: str = "",
        decides: str = "",
        undo: Callable[[], object] | None = None,
    ) -> T:
        """COLLECTIVE: `decide` on rank 0 over every rank's `local()`, broadcast. `what` /
        `decides` prefix the text of a failure of each part. A `local` that returns a
        RankFailure reports that failure as its own. `undo`: rank 0's clean-up when a rank's
        local work failed, done before any rank raises."""
        values, failures, own = self._gather(local, what=what)
        if failures and undo is not None:
            if self.group.rank == 0:
                undo()
            self.group.barrier()
        if failures:
            self._raise(failures, own, keep=())
        return self.decide(lambda: decide(values), what=decides)

    def gather(self, local: Callable[[], L], *, what: str = "") -> list[L]:
        """COLLECTIVE: every rank's `local()`, in rank order, on every rank; or, when any rank
        failed, the error on all."""
        values, failures, own = self._gather(local, what=what)
        if failures:  # own is among them when this rank failed
            self._raise(failures, own, keep=())
        return values

    def _gather(
        self, local: Callable[[], L], *, what: str
    ) -> tuple[list[L], list[RankFailure], BaseException | None]:
        own: BaseException | None = None
        try:
            mine: Any = local()
        except BaseException as exc:  # told to the others first, raised by the caller
            own, mine = exc, failure_of(exc, rank=self.group.rank, what=what)
        gathered = self.group.all_gather(mine)
        failures = [v for v in gathered if isinstance(v, RankFailure)]
        return cast(list[L], gathered), failures, own

    def decide(self, decide: Callable[[], T], *, what: str = "") -> T:
        """COLLECTIVE: rank 0's `decide()`, broadcast to every rank; or its failure, on all."""
        if self.group.rank != 0:
            received: Any = self.group.broadcast(None)
            if isinstance(received, _Failed):
                self._raise(received.failures, None, keep=())
            return cast(T, received)
        try:
            outcome = decide()
        except RanksFailed as exc:  # other ranks' failures, found by rank 0
            self.group.broadcast(_Failed(exc.failures))
            self._raise(exc.failures, None, keep=())
        except BaseException as exc:
            failures = [failure_of(exc, rank=0, what=what)]
            self.group.broadcast(_Failed(failures))
            self._raise(failures, exc, keep=self.own)
        self.group.broadcast(outcome)
        return outcome

    def _raise(
        self,
        failures: Sequence[RankFailure],
        own: BaseException | None,
        *,
        keep: tuple[type[BaseException], ...],
    ) -> NoReturn:
        if own is not None and (not isinstance(own, Exception) or isinstance(own, keep)):
            raise own
        raise self.fail(list(failures), self.group.rank) from own


class RanksFailed(Exception):
    """Raised by a `decide` that found failures of other ranks in what they sent (a file rank
    0 cannot see): told and raised as theirs, not as rank 0's."""

    def __init__(self, failures: list[RankFailure]) -> None:
        super().__init__("; ".join(f"rank {f.rank}: {f.what}" for f in failures))
        self.failures = failures


@dataclass(frozen=True)
class _Failed:
    """What rank 0 broadcasts instead of an outcome (a class of its own: an outcome may be a
    list, or a RankFailure)."""

    failures: list[RankFailure]
