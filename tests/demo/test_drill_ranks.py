"""`runner drill --ranks 2`: real torchrun launches (gloo, CPU), a real SIGTERM to rank 1's
worker, a resume at 2 ranks and one at 1 rank, audited from the demo's sample logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runner.demo.drill_ranks_report import ABLATIONS_SKIPPED, FINGERPRINT_NOTE, read_samples

STEPS, STOP_AT, BATCH = 24, 9, 4


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
