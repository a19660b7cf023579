"""The one per-rank error of the ranks' collective steps: what went wrong on one rank, told
to every rank, so that every rank raises alike, naming each rank that failed.

A rank never raises out of a collective step on its own (the others would wait for it until
the timeout): it hands its `RankFailure` (or None) to `gather_failures`, and every rank then
raises the same error built from the same list (`describe`). The commit protocols
(runner.checkpoint.ranked, runner.mirror.nodes), the multi-node load
(runner.mirror.node_resume.raise_on_all) and rank 0's decisions told to every rank
(runner.session.coordination.decided_on_primary) use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runner.collective.group import Group
from runner.errors import EXIT_FAILURE


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank, as every rank is told."""

    rank: int
    what: str
    kind: str = "other"
    """What sort of failure it is (e.g. a store error worth retrying): the caller maps the
    kinds of all failures to the one error every rank raises."""
    exit_code: int = EXIT_FAILURE
    """The exit code of the error it stands for (rank 0's refusal to resume: 2, 3 or 75)."""


def gather_failures(group: Group, mine: RankFailure | None) -> list[RankFailure]:
    """COLLECTIVE: every rank's failure in rank order (none when every rank succeeded), on
    every rank."""
    return [f for f in group.all_gather(mine) if f is not None]


def describe(failures: Sequence[RankFailure], *, rank: int | None = None) -> str:
    """One line naming each failed rank and what went wrong there; " (this one)" when `rank`
    (the caller's) is among them."""
    what = "; ".join(f"rank {f.rank}: {f.what}" for f in failures)
    mine = rank is not None and any(f.rank == rank for f in failures)
    return what + (" (this one)" if mine else "")
