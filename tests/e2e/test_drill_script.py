"""`runner drill -- CMD`: the resume audit of a user's own script, with real processes and a
real SIGTERM. A nanoGPT-style loop that prefetches its next batch resumes inexactly, and the
drill names the first step after the resume; the same loop with the batch in
`ModuleTrainState(extra=...)` is reported exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.fixtures.supervised import REPO

LOOP = REPO / "tests" / "trainers" / "prefetch_loop.py"


def _drill(tmp_path: Path, *script: str) -> tuple[int, dict[str, object], str]:
    drill = [sys.executable, "-m", "runner", "drill", "--json", "--work-dir", str(tmp_path / "w")]
    loop = [sys.executable, str(LOOP), "--steps", "30", "--step-seconds", "0.03", *script]
    done = subprocess.run(
        [*drill, "--", *loop],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "RUNNER_MIRROR": "s3://nowhere/x"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, report, done.stderr


def test_a_prefetched_batch_outside_the_checkpoint_is_not_exact(tmp_path: Path) -> None:
    code, report, err = _drill(tmp_path)
    assert code == 3, err
    assert report["exact"] is False
    resumed_from = report["resumed_from"]
    assert isinstance(resumed_from, int) and 5 <= resumed_from < 30
    assert report["first_differing_step"] == resumed_from + 1
    assert "A batch fetched before the stop" in str(report["causes"])
    assert report["straight_fingerprint"] != report["resumed_fingerprint"]
    assert f"the resumed run differs from the straight one from step {resumed_from + 1}" in err
    # each copy ran in a directory of its own, its relative run dir there
    work = tmp_path / "w"
    assert sorted(p.name for p in work.iterdir()) == ["stopped", "straight"]
    assert (work / "straight" / "runs" / "gpt" / "checkpoints").is_dir()


def test_the_batch_in_extra_makes_it_exact(tmp_path: Path) -> None:
    code, report, err = _drill(tmp_path, "--batch-in-extra")
    assert code == 0, err
    assert report["exact"] is True and report["first_differing_step"] is None
    assert report["straight_fingerprint"] == report["resumed_fingerprint"]


def test_a_command_that_leaves_no_checkpoint_is_said_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "runner", "drill", "--", sys.executable, "-c", "pass"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "the command left no checkpoint under its working directory" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_lightning_script_with_the_callback_is_exact(tmp_path: Path) -> None:
    """An integration's checkpoints carry the weights' fingerprint and its losses reach
    loss.jsonl: the drill audits a Lightning script with no TrainSession in it (a shuffling
    loader, dropout, the stop mid-epoch)."""
    trainer = REPO / "tests" / "trainers" / "lightning_callback.py"
    drill = [sys.executable, "-m", "runner", "drill", "--json", "--work-dir", str(tmp_path / "w")]
    script = [sys.executable, str(trainer), "runs/pl", "-", "20", "5", "0.05"]
    done = subprocess.run(
        [*drill, "--seed", "3", "--", *script],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["exact"] is True
    assert report["straight_fingerprint"] and len(report["straight_fingerprint"]) == 64
    assert report["straight_fingerprint"] == report["resumed_fingerprint"]
    losses = (tmp_path / "w" / "straight" / "runs" / "pl" / "loss.jsonl").read_text().splitlines()
    assert len([line for line in losses if '"step"' in line]) == 20
