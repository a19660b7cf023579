"""`runner drill --ranks 2`: real torchrun launches (gloo, CPU), a real SIGTERM to rank 1's
worker, a resume at 2 ranks and one at 1 rank, audited from the demo's sample logs; and the
audit itself on sample logs written here, where a sample is consumed twice, skipped or extra."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runner.demo.drill import DrillReport, RunOutcome
from runner.demo.drill_ranks_report import (
    ABLATIONS_SKIPPED,
    FINGERPRINT_NOTE,
    RankedDrillReport,
    Rescaled,
    SampleAudit,
    audit_samples,
    read_samples,
)

STEPS, STOP_AT, BATCH = 24, 9, 4


@pytest.mark.slow
def test_drill_on_two_ranks_resumes_exactly_and_at_one_rank_consumes_each_sample_once(
    tmp_path: Path,
) -> None:
    cmd = [sys.executable, "-m", "runner", "drill", "--ranks", "2", "--steps", str(STEPS),
           "--stop-at", str(STOP_AT), "--json", "--work-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    stopped = report["stopped_at"]
    # the stop lands after the step the signal arrived in, on both ranks; room is left after it
    assert STOP_AT <= stopped < STEPS
    rescaled = report.pop("rescaled")
    fingerprint = report["straight_fingerprint"]
    assert report == {
        "save_mode": "async",
        "steps": STEPS,
        "world_sizes": {"straight": 2, "resumed": 2, "rescaled": 1},
        "stopped_at": stopped,
        "stopped_rank": 1,
        "exact": True,
        "straight_fingerprint": fingerprint,
        "resumed_fingerprint": fingerprint,
        "ablations": [],
        "ablations_skipped": ABLATIONS_SKIPPED,
    }
    assert len(fingerprint) == 64
    total = STEPS * 2 * BATCH
    assert rescaled == {
        "world_size": 1,
        "resumed_at_step": stopped * 2,  # step x N / M
        "final_step": STEPS * 2,  # the run's length is fixed in samples
        "stopped_samples_seen": stopped * 2 * BATCH,
        "samples_seen": total,
        "straight_samples_seen": total,
        "samples_equal": True,
        "exactly_once": True,
        "duplicated": 0,
        "missing": 0,
        "unexpected": 0,
        "fingerprint": rescaled["fingerprint"],
        "fingerprint_note": FINGERPRINT_NOTE,
    }
    assert rescaled["fingerprint"] != fingerprint

    # the sample logs the audit read: per rank under torchrun, one file for the plain process
    straight = read_samples(tmp_path / "straight.samples.jsonl")
    before = read_samples(tmp_path / "stopped.samples.jsonl")
    after = read_samples(tmp_path / "rescaled.samples.jsonl")
    assert sorted((line["step"], line["rank"]) for line in straight) == [
        (step, rank) for step in range(1, STEPS + 1) for rank in (0, 1)
    ]
    assert {line["rank"] for line in after} == {0}
    assert sorted(line["step"] for line in after) == list(range(stopped * 2 + 1, STEPS * 2 + 1))
    indices = [i for line in before + after for i in line["indices"]]
    assert len(indices) == len(set(indices)) == total
    assert set(indices) == {i for line in straight for i in line["indices"]}


def write_log(path: Path, *steps: tuple[int, int, int, list[int]]) -> None:
    """(step, rank, epoch, indices) lines, as `runner demo --sample-log` writes them."""
    with open(path, "a", encoding="utf-8") as out:
        for step, rank, epoch, indices in steps:
            line = {"step": step, "rank": rank, "epoch": epoch, "indices": indices}
            out.write(json.dumps(line) + "\n")


def audit(tmp_path: Path, after: list[int]) -> SampleAudit:
    """Straight on 2 ranks: epoch 0 [0..7], then epoch 1 [3, 1]; stopped after step 1 on 2
    ranks ([0, 1] and [2, 3]); resumed on 1 rank consuming `after` in epoch 0, then [3, 1]."""
    straight, before, resumed = (tmp_path / f"{n}.jsonl" for n in ("straight", "stopped", "res"))
    write_log(straight.with_name("straight.jsonl.rank0"), (1, 0, 0, [0, 1]), (2, 0, 0, [4, 5]),
              (3, 0, 1, [3]))  # fmt: skip
    write_log(straight.with_name("straight.jsonl.rank1"), (1, 1, 0, [2, 3]), (2, 1, 0, [6, 7]),
              (3, 1, 1, [1]))  # fmt: skip
    write_log(before.with_name("stopped.jsonl.rank0"), (1, 0, 0, [0, 1]))
    write_log(before.with_name("stopped.jsonl.rank1"), (1, 1, 0, [2, 3]))
    write_log(resumed, (3, 0, 0, after), (4, 0, 1, [3, 1]))
    return audit_samples(straight=straight, before=before, after=resumed)


def test_sample_audit_passes_each_sample_once_per_epoch(tmp_path: Path) -> None:
    result = audit(tmp_path, [4, 5, 6, 7])
    assert result == SampleAudit(duplicated=0, missing=0, unexpected=0)
    assert result.exactly_once is True


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        ([3, 4, 5, 6, 7], SampleAudit(duplicated=1, missing=0, unexpected=0)),  # 3 again
        ([4, 5, 7], SampleAudit(duplicated=0, missing=1, unexpected=0)),  # 6 skipped
        ([4, 5, 6, 7, 9], SampleAudit(duplicated=0, missing=0, unexpected=1)),  # past the end
        ([4, 4, 5, 7, 8], SampleAudit(duplicated=1, missing=1, unexpected=1)),
    ],
)
def test_sample_audit_counts_a_sample_twice_skipped_or_extra(
    tmp_path: Path, after: list[int], expected: SampleAudit
) -> None:
    result = audit(tmp_path, after)
    assert result == expected
    assert result.exactly_once is False


def ranked_report(*, resumed: str, samples_seen: int, audit: SampleAudit) -> RankedDrillReport:
    losses = {1: 4.0, 2: 3.5}
    return RankedDrillReport(
        ranks=2,
        base=DrillReport(
            steps=2,
            stopped_at=1,
            straight=RunOutcome(fingerprint="a" * 64, losses=losses),
            resumed=RunOutcome(fingerprint=resumed, losses=losses),
        ),
        straight_samples=16,
        stopped_samples=8,
        rescaled=Rescaled(world_size=1, resumed_at_step=2, final_step=4,
                          samples_seen=samples_seen, fingerprint="b" * 64, samples=audit),
    )  # fmt: skip


def test_drill_failure_names_what_differs_first_exactness_then_samples() -> None:
    once, twice = (
        SampleAudit(duplicated=0, missing=0, unexpected=0),
        SampleAudit(duplicated=2, missing=1, unexpected=0),
    )
    assert ranked_report(resumed="a" * 64, samples_seen=16, audit=once).failure() is None
    assert ranked_report(resumed="c" * 64, samples_seen=20, audit=twice).failure() == (
        "the resumed run differs from the straight run: resume is not exact"
    )
    assert ranked_report(resumed="a" * 64, samples_seen=20, audit=twice).failure() == (
        "resumed on 1 rank the run ended at samples_seen 20, the straight run at 16"
    )
    assert ranked_report(resumed="a" * 64, samples_seen=16, audit=twice).failure() == (
        "resumed on 1 rank, samples were not consumed exactly once: 2 samples twice, "
        "1 skipped, 0 not in the straight run"
    )
