"""`runner drill`: real processes, a real SIGTERM, and the omission table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_drill_reports_exact_resume_and_the_cost_of_each_omission() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runner", "drill", "--steps", "40", "--stop-at", "7", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["exact"] is True
    assert report["stopped_at"] >= 7
    assert report["straight_fingerprint"] == report["resumed_fingerprint"]
    rows = {row["name"]: row for row in report["ablations"]}
    assert rows["exact resume"]["max_weight_diff"] == 0.0
    assert rows["exact resume"]["final_loss_diff"] == 0.0
    damaged = [row for name, row in rows.items() if name != "exact resume"]
    assert len(damaged) == 4
    for row in damaged:
        assert row["max_weight_diff"] > 0.0, row
        assert row["fingerprint_match"] is False, row
