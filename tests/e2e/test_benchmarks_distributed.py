"""benchmarks/distributed.py's "save" and "upload" sections still run against the current code
(real torchrun launches, gloo, a real SeaweedFS; 2 MB of parameters, one round): each measures
what its table reports, the every-rank upload is a mirrored checkpoint that verifies, and the
table prints every ratio the README quotes. This checks that it works, not how fast anything is.
(The "agreement" section's smoke run is tests/collective/test_agreement_benchmark.py.)"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

from tests.fixtures.s3 import BENCH_S3_ENDPOINT, SeaweedS3

REPO = Path(__file__).resolve().parents[2]
BENCHMARK = REPO / "benchmarks" / "distributed.py"
# 8 Linear(250, 250) layers (2 MB / 4 bytes / 8 layers = 250 x 250), params + AdamW m and v
PARAMS = 8 * (250 * 250 + 250)


def _session_s3(server: SeaweedS3) -> dict[str, str]:
    """The session's SeaweedFS for the benchmark (instead of starting its own: ~7 s)."""
    return {**server.env(), BENCH_S3_ENDPOINT: server.endpoint}


TINY = ["--save-mb", "2", "--save-ranks", "1,2", "--rounds", "1", "--saves", "1"]
UPLOAD_MODES = ["every rank", "one uploader, pool", "one uploader, serial"]


def test_the_save_and_upload_sections_measure_and_report(
    tmp_path: Path, s3_server: SeaweedS3
) -> None:
    options = [*TINY, "--json", "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--sections", "save,upload", *options],
        cwd=tmp_path,
        env={**os.environ, **_session_s3(s3_server), "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(done.stdout)
    assert list(results) == ["save", "upload"]
    assert list(tmp_path.iterdir()) == [], "the benchmark leaves its scratch files behind"

    save = results["save"]
    assert sorted(save) == ["1", "2"]
    for world in (1, 2):
        [one_round] = save[str(world)]["rounds"]
        assert one_round["world_size"] == world
        assert one_round["state_bytes"] == 3 * 4 * PARAMS
        written = one_round["rank_bytes"]
        assert sorted(written) == [str(r) for r in range(world)], written
        assert all(size > 0 for size in written.values()), written  # DCP split the writes
        assert sum(written.values()) == one_round["checkpoint_bytes"]
        assert len(one_round["seconds"]) == 1 and one_round["seconds"][0] > 0
        assert len(one_round["torch_save_seconds"]) == (1 if world == 1 else 0)

    [(world, upload)] = results["upload"].items()
    assert world == "2" and upload["world_size"] == 2
    assert upload["target"] == f"S3 at {s3_server.endpoint}", upload["target"]
    assert upload["every_rank_copy_verifies"] is True
    assert sorted(upload["rank_bytes"]) == ["0", "1"]
    assert sum(upload["rank_bytes"].values()) == upload["checkpoint_bytes"]
    assert list(upload["seconds"]) == UPLOAD_MODES
    assert all(len(t) == 1 and t[0] > 0 for t in upload["seconds"].values()), upload

    # The tables the plain run prints, from the same figures.
    sections = runpy.run_path(str(BENCHMARK), run_name="bench_distributed")["SECTIONS"]
    lines = sections["save"].report({int(k): v for k, v in save.items()})
    assert lines[0].startswith("save: one checkpoint of the same replicated state (6 MB"), lines
    for prefix in (
        f"{'write_ranked':<22}     1",
        f"{'write_ranked':<22}     2",
        f"{'torch.save + fsync':<22}     1",
        "save: 2 ranks / 1 rank (seconds; same round): ",
        "save: 1 rank write_ranked / torch.save + fsync (seconds; same launch): ",
    ):
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    lines = sections["upload"].report({2: upload})
    assert lines[0].startswith("upload: the ") and f"S3 at {s3_server.endpoint}" in lines[0], lines
    for prefix in (
        *(f"{name:<24}" for name in UPLOAD_MODES),
        "upload: every rank / one uploader, pool (MB/s; same round): ",
        "upload: every rank / one uploader, serial (MB/s; same round): ",
    ):
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    assert lines[-1] == "the every-rank copy verifies (runner.checkpoint.verify, streamed)"
