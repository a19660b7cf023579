"""The report of `runner drill --ranks N`: what the three runs showed, as a table or JSON,
and the sample-log audit (every sample of the straight run consumed exactly once across a
change of world size)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.demo.drill import DrillReport

FINGERPRINT_NOTE = (
    "not compared with the straight run's: at another world size the gradients' float sums "
    "are reduced in another order"
)
ABLATIONS_SKIPPED = "the omission table is single-process: run `runner drill` without --ranks"

Sample = tuple[int, int]  # (epoch, dataset index)


@dataclass(frozen=True, kw_only=True)
class Rescaled:
    """The stopped checkpoint resumed at another world size, to the end of the run."""

    world_size: int
    resumed_at_step: int
    final_step: int
    samples_seen: int
    fingerprint: str
    samples: SampleAudit


@dataclass(frozen=True, kw_only=True)
class SampleAudit:
    """Samples consumed across a change of world size, against the straight run's: counted
    twice, never consumed (skipped), consumed but not by the straight run."""

    duplicated: int
    missing: int
    unexpected: int

    @property
    def exactly_once(self) -> bool:
        return self.duplicated == self.missing == self.unexpected == 0


@dataclass(frozen=True, kw_only=True)
class RankedDrillReport:
    ranks: int
    base: DrillReport  # the straight and the N-rank resumed runs
    straight_samples: int
    stopped_samples: int
    rescaled: Rescaled

    @property
    def samples_equal(self) -> bool:
        return self.rescaled.samples_seen == self.straight_samples

    def failure(self) -> str | None:
        """Why the audit failed (the message of the IntegrityError), None when it passed."""
        if not self.base.exact:
            return "the resumed run differs from the straight run: resume is not exact"
        if not self.samples_equal:
            return (
                f"resumed on {_ranks(self.rescaled.world_size)} the run ended at samples_seen "
                f"{self.rescaled.samples_seen}, the straight run at {self.straight_samples}"
            )
        if not self.rescaled.samples.exactly_once:
            return (
                f"resumed on {_ranks(self.rescaled.world_size)}, samples were not consumed "
                f"exactly once: {_audit_text(self.rescaled.samples)}"
            )
        return None


def read_samples(path: Path) -> list[dict[str, Any]]:
    """Every line the demo's --sample-log wrote at `path` (one process) and `path.rank<R>`."""
    lines = []
    for file in [path, *sorted(path.parent.glob(f"{path.name}.rank*"))]:
        if file.exists():
            lines += [json.loads(line) for line in file.read_text().splitlines() if line]
    return lines


def consumed(lines: list[dict[str, Any]]) -> Counter[Sample]:
    return Counter((line["epoch"], index) for line in lines for index in line["indices"])


def audit_samples(*, straight: Path, before: Path, after: Path) -> SampleAudit:
    """The sample logs of a run stopped (`before`) and resumed at another world size
    (`after`), against the straight run's: each (epoch, index) it consumed, once."""
    reference = consumed(read_samples(straight))
    taken = consumed(read_samples(before)) + consumed(read_samples(after))
    return SampleAudit(
        duplicated=sum(n - 1 for n in taken.values() if n > 1),
        missing=len(reference.keys() - taken.keys()),
        unexpected=len(taken.keys() - reference.keys()),
    )


def report_json(report: RankedDrillReport) -> str:
    base, rescaled = report.base, report.rescaled
    return json.dumps(
        {
            "steps": base.steps,
            "world_sizes": {
                "straight": report.ranks,
                "resumed": report.ranks,
                "rescaled": rescaled.world_size,
            },
            "stopped_at": base.stopped_at,
            "stopped_rank": report.ranks - 1,
            "exact": base.exact,
            "straight_fingerprint": base.straight.fingerprint,
            "resumed_fingerprint": base.resumed.fingerprint,
            "rescaled": {
                "world_size": rescaled.world_size,
                "resumed_at_step": rescaled.resumed_at_step,
                "final_step": rescaled.final_step,
                "stopped_samples_seen": report.stopped_samples,
                "samples_seen": rescaled.samples_seen,
                "straight_samples_seen": report.straight_samples,
                "samples_equal": report.samples_equal,
                "exactly_once": rescaled.samples.exactly_once,
                "duplicated": rescaled.samples.duplicated,
                "missing": rescaled.samples.missing,
                "unexpected": rescaled.samples.unexpected,
                "fingerprint": rescaled.fingerprint,
                "fingerprint_note": FINGERPRINT_NOTE,
            },
            "ablations": [],
            "ablations_skipped": ABLATIONS_SKIPPED,
        },
        indent=2,
    )


def report_text(report: RankedDrillReport) -> str:
    base, rescaled, n, m = report.base, report.rescaled, report.ranks, report.rescaled.world_size
    verdict = "IDENTICAL" if base.exact else "DIFFERENT"
    samples = "EQUAL" if report.samples_equal else "DIFFERENT"
    once = _audit_text(rescaled.samples)
    return (
        f"straight {base.steps} steps on {_ranks(n)} vs SIGTERM to rank {n - 1} at step "
        f"{base.stopped_at} + resume on {_ranks(n)}: {verdict}\n"
        f"  fingerprint straight {base.straight.fingerprint[:16]}  "
        f"resumed {base.resumed.fingerprint[:16]}\n"
        f"  loss history: {base.loss_verdict()}\n"
        f"the step {base.stopped_at} checkpoint ({_ranks(n)}) resumed on {_ranks(m)}: "
        f"step {base.stopped_at} -> {rescaled.resumed_at_step}, ended at step "
        f"{rescaled.final_step}\n"
        f"  samples_seen {rescaled.samples_seen} vs straight {report.straight_samples}: "
        f"{samples}\n"
        f"  samples across the change ({report.stopped_samples} on {n}, the rest on {m}): "
        f"{once}\n"
        f"  fingerprint {rescaled.fingerprint[:16]}: {FINGERPRINT_NOTE}\n\n"
        f"{ABLATIONS_SKIPPED[0].upper()}{ABLATIONS_SKIPPED[1:]} (skipped here: {n} and {m} "
        "ranks)."
    )


def _ranks(n: int) -> str:
    return "1 rank" if n == 1 else f"{n} ranks"


def _audit_text(audit: SampleAudit) -> str:
    if audit.exactly_once:
        return "every sample consumed exactly once"
    return (
        f"{audit.duplicated} samples twice, {audit.missing} skipped, "
        f"{audit.unexpected} not in the straight run"
    )
