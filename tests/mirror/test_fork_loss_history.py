"""`runner fork` from a location without loss.jsonl (a mirror bucket) still gives the fork the
loss history up to its step: from the history the checkpoint itself carries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.ckpt import SaveCheckpoint, tiny_train_state
from tests.fixtures.demo_process import run_demo


def runner(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_fork_from_a_bucket_restores_the_loss_history_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    run_dir, bucket = tmp_path / "run", tmp_path / "bucket"
    demo = run_demo(run_dir, "--mirror", f"file://{bucket}", steps=6, ckpt_every=3)
    assert demo.returncode == 0, demo.stderr
    assert not (bucket / "loss.jsonl").exists()  # the mirror holds checkpoints only
    logged = {x["step"]: x["loss"] for x in _lines(run_dir / "loss.jsonl")}

    dst = tmp_path / "fork"
    result = runner("fork", f"file://{bucket}", dst)
    assert result.returncode == 0, result.stderr
    assert "forked step 6" in result.stdout and "(6 loss lines)" in result.stdout
    forked = _lines(dst / "loss.jsonl")
    assert [(x["step"], x["loss"]) for x in forked] == sorted(logged.items())
    assert all(x["restored_from"] == "checkpoint step 6" for x in forked)

    again = runner("fork", f"file://{bucket}", tmp_path / "fork3", "--step", "3", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["loss_steps"] == 3
    assert [x["step"] for x in _lines(tmp_path / "fork3/loss.jsonl")] == [1, 2, 3]


@pytest.mark.slow
def test_fork_fills_only_the_steps_the_source_log_lacks(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(4)
    history = tiny_train_state(seed=4, steps=4)["loss_history"]
    src = tmp_path / "run"
    (src / "loss.jsonl").write_text(
        json.dumps({"step": 1, "loss": 10.0}) + "\n" + json.dumps({"step": 2, "loss": 20.0}) + "\n"
    )
    result = runner("fork", src, tmp_path / "fork", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["loss_steps"] == 4
    forked = _lines(tmp_path / "fork/loss.jsonl")
    # what the source logged stands (the audit trail); the rest comes from the checkpoint
    assert [(x["step"], x["loss"], x.get("restored_from")) for x in forked] == [
        (1, 10.0, None),
        (2, 20.0, None),
        (3, history[2], "checkpoint step 4"),
        (4, history[3], "checkpoint step 4"),
    ]
