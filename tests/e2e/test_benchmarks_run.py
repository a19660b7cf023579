"""The benchmark scripts still run against the current code (a module move once broke an import
in benchmarks/save.py without any test noticing). Tiny sizes: this checks that they work and
print every ratio the README quotes, not how fast anything is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.fixtures.s3 import BENCH_S3_ENDPOINT, SeaweedS3

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, cwd: Path, s3: SeaweedS3 | None = None) -> str:
    # the session's SeaweedFS, instead of the benchmark starting its own (~7 s)
    store = {} if s3 is None else {**s3.env(), BENCH_S3_ENDPOINT: s3.endpoint}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=cwd,
        env={**os.environ, **store, "PYTHONPATH": str(REPO)},
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
        "load: runner mmap / raw read",
        "load: runner / runner, hashing first",
    ):
        assert line in out, out
    assert list(tmp_path.iterdir()) == [], "the benchmark leaves its scratch files behind"


def test_mirror_benchmark_prints_every_ratio(tmp_path, s3_server):
    out = _run("mirror.py", "--size-mb", "2", "--dir", str(tmp_path), cwd=tmp_path, s3=s3_server)
    assert f"checkpoint: 2 MB, S3 at {s3_server.endpoint}" in out, out
    for line in (
        "ratio upload   runner / boto3 default:",
        "ratio download runner / boto3 default:",
        "ratio download runner / boto3 + fsync + sha256:",
        "final checkpoint upload_now: ",
        "final checkpoint upload_now, 2 nodes at once (2 MB each), until the last landed: ",
        "runner demo: SIGTERM to exit 75 with the final checkpoint in the bucket: ",
    ):
        assert line in out, out


def test_goodput_benchmark_replays_a_trace_and_reports_each_cadence(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(
        '{"name": "tiny", "hours": 2, "mtbf_hours": 1, "source": "test",'
        ' "events": [{"at_hours": 0.9, "kind": "kill"}, {"at_hours": 1.4, "kind": "notice"}]}'
    )
    out = _run(
        "goodput.py", "--trace", str(trace), "--hour-seconds", "3", "--cadences", "2",
        "--quick", "--dir", str(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert "trace tiny: 2 h, 1 failures without notice, 1 with notice" in out, out
    rows = [row for row in map(str.split, out.splitlines()) if row[1:2] and row[1].endswith("%")]
    assert [row[0] for row in rows] == ["2", "auto"], out
    assert "auto - best fixed (2 s): " in out, out
    assert "one preemption with notice: SIGTERM to exit " in out, out
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"], "scratch files left behind"


def test_resume_benchmark_times_both_resumes_and_reports_the_ratio(tmp_path, s3_server):
    out = _run("resume.py", "--params", "200000", "--rounds", "1", "--profile",
               "--dir", str(tmp_path), cwd=tmp_path, s3=s3_server)  # fmt: skip
    assert "state: 20" in out and f"S3 at {s3_server.endpoint}" in out, out
    assert re.search(r"^round 1: plain \d+\.\d\d s, runner \d+\.\d\d s, ratio ", out, re.M), out
    assert "resume from the bucket: runner / plain " in out, out
    # the restore's work runs in a worker thread: its profile shows the download
    worker = out.split("profile of one runner resume, its worker (cumulative):")[1]
    assert "download_checkpoint" in worker, out
    assert list(tmp_path.iterdir()) == [], "scratch files left behind"
