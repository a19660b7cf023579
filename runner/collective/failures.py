"""The one per-rank error of the ranks' collective steps: what went wrong on one rank, told
to every rank, so that every rank raises alike, naming each rank that failed.

A rank never raises out of a collective step on its own (the others would wait for it until
the timeout): runner.collective.step gathers every rank's `RankFailure` (or its value), and
every rank then raises the same error built from the same list (`describe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def describe(failures: Sequence[RankFailure], *, rank: int | None = None) -> str:
    """One line naming each failed rank and what went wrong there; " (this one)" when `rank`
    (the caller's) is among them."""
    what = "; ".join(f"rank {f.rank}: {f.what}" for f in failures)
    mine = rank is not None and any(f.rank == rank for f in failures)
    return what + (" (this one)" if mine else "")
