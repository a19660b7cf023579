"""`runner demo` and `runner run` take --store-timeout like every store command, and it
reaches their mirror; unlike a one-shot command, a training run's mirror keeps trying each
later checkpoint after a call gave up. The store is the loopback fake of test_store_budget
(lists fine, answers every other request with an immediate 500: no real server does)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.demo_process import demo_cmd
from tests.fixtures.fake_store import START_MARGIN_S, FakeStore, env_for


@pytest.mark.slow
def test_fake_500_store_demo_store_timeout_reaches_the_mirror_and_later_uploads_are_tried(
    tmp_path: Path,
) -> None:
    store = FakeStore("slow-500", delay=0.0, listing=[])
    try:
        extra = ("--mirror", "s3://bucket/run", "--store-timeout", "3")
        result = subprocess.run(
            demo_cmd(tmp_path / "run", *extra, steps=400, ckpt_every=20),
            capture_output=True,
            text=True,
            env=env_for(store.endpoint),
            timeout=300,
        )
    finally:
        store.close()
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    # finished, but the final checkpoint is not in the mirror
    assert result.returncode == 1, output
    failed = [
        line
        for line in output.splitlines()
        if "mirror: upload of step" in line and "failed: " in line
    ]
    assert len(failed) >= 2, output  # a periodic upload, and the final one still tried
    assert all("gave up after" in line and "store timeout 3 s" in line for line in failed)
    assert "not tried" not in output, output


@pytest.mark.slow
def test_fake_500_store_runner_run_start_up_gives_up_within_its_store_timeout(
    tmp_path: Path,
) -> None:
    store = FakeStore("slow-500", delay=0.0)
    started = time.monotonic()
    try:
        args = [
            "--run-dir",
            tmp_path / "run",
            "--mirror",
            "s3://bucket/run",
            "--store-timeout",
            "3",
        ]
        result = subprocess.run(
            [sys.executable, "-m", "runner", "run", *map(str, args), "--", "true"],
            capture_output=True,
            text=True,
            env=env_for(store.endpoint),
            timeout=300,
        )
    finally:
        store.close()
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "list s3://bucket/run/checkpoints/: gave up after" in result.stderr
    assert "store timeout 3 s" in result.stderr
    assert took <= 3 + START_MARGIN_S, took


@pytest.mark.parametrize("command", ["demo", "run"])
def test_store_timeout_of_demo_and_run_is_range_checked(command: str, tmp_path: Path) -> None:
    args = ["--run-dir", str(tmp_path / "run"), "--store-timeout", "0.5"]
    trainer = ["--", "true"] if command == "run" else ["--steps", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "runner", command, *args, *trainer],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--store-timeout" in result.stderr and "Traceback" not in result.stderr
