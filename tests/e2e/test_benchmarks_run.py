"""The benchmark scripts still run against the current code (a module move once broke an import
in benchmarks/save.py without any test noticing). Tiny sizes: this checks that they work and
print every ratio the README quotes, not how fast anything is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, cwd: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_save_benchmark_prints_every_ratio(tmp_path):
    out = _run("save.py", "--params", "200000", "--dir", str(tmp_path), cwd=tmp_path)
    for line in (
        "save: runner / raw write + fsync",
        "save: runner / torch.save + fsync",
        "save: runner / runner, no early writeback",
        "load: runner / raw read",
        "load: runner / torch.load",
        "load: runner mmap / torch.load",
    ):
        assert line in out, out
    assert list(tmp_path.iterdir()) == [], "the benchmark leaves its scratch files behind"


def test_mirror_benchmark_prints_every_ratio(tmp_path):
    out = _run("mirror.py", "--size-mb", "2", "--dir", str(tmp_path), cwd=tmp_path)
    assert "checkpoint: 2 MB, SeaweedFS at http://127.0.0.1:" in out, out
    for line in (
        "ratio upload   runner / boto3 default:",
        "ratio download runner / boto3 default:",
        "ratio download runner / boto3 + fsync + sha256:",
        "final checkpoint upload_now: ",
        "runner demo: SIGTERM to exit 75 with the final checkpoint in the bucket: ",
    ):
        assert line in out, out
