"""benchmarks/distributed.py still runs against the current code (real torchrun, 2 ranks, tiny
counts): every mechanism of the agreement section is measured (--json) and its table is printed.
This checks that it works, not how fast anything is."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = REPO / "benchmarks" / "distributed.py"
MECHANISMS = [
    "agree every step",
    "store check every step",
    "agree every 4 steps",
    "agree every 16 steps",
]
TINY = ["--ranks", "2", "--iterations", "20", "--loop-steps", "3", "--warmup-steps", "1"]
TINY += ["--sections", "agreement"]  # the others: tests/e2e/test_benchmarks_distributed.py


def _run(*args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), *TINY, *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_agreement_section_measures_and_reports_every_mechanism(tmp_path: Path) -> None:
    results = json.loads(_run("--json", cwd=tmp_path))
    assert list(results) == ["agreement"]
    two = results["agreement"]["2"]
    assert two["world_size"] == 2
    assert two["train_step_us"] > 0 and two["dp_step_us"] > 0
    for key in ("mean", "median", "in_loop"):
        assert list(two[key]) == MECHANISMS, key
    assert all(us > 0 for us in two["mean"].values()), two["mean"]

    # The table the plain run prints, from the same figures.
    sections = runpy.run_path(str(BENCHMARK), run_name="bench_distributed")["SECTIONS"]
    lines = sections["agreement"].report({2: two})
    assert lines[0].startswith("agreement: cost per training step"), lines
    for name in MECHANISMS:
        row = next(line for line in lines if line.startswith(f"{name:<24}     2"))
        assert f"{two['mean'][name]:.1f}" in row, row
    assert any(line.startswith(f"{'demo train_step':<24}     2") for line in lines), lines
