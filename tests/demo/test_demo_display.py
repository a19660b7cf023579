"""The demo's live progress line: the last checkpoint's age grows between commits and resets
only when a checkpoint is committed (the stale-checkpoint signal the line exists for)."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from runner.demo.display import ProgressDisplay
from tests.fixtures.demo_process import demo_cmd

REPO = Path(__file__).resolve().parents[2]
LINE = re.compile(r"step (\d+)/\d+ [^\r\n]*?last checkpoint: step (\d+) \((\d+)s ago\)")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _shown(stream: io.StringIO) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m.groups())) for m in LINE.finditer(stream.getvalue())]  # type: ignore[misc]


def test_age_grows_between_checkpoints_and_resets_on_a_commit() -> None:
    clock = Clock()
    out = io.StringIO()
    display = ProgressDisplay(total_steps=100, stream=out, live=True, clock=clock)
    display.update(step=1, loss=1.0)
    assert "last checkpoint: none yet" in out.getvalue()
    display.checkpoint(10)
    for step in range(11, 15):
        clock.now += 7
        display.update(step=step, loss=1.0)
    display.checkpoint(20)
    clock.now += 3
    display.update(step=21, loss=1.0)
    assert _shown(out) == [(11, 10, 7), (12, 10, 14), (13, 10, 21), (14, 10, 28), (21, 20, 3)]


def test_a_resumed_checkpoint_shows_its_real_age() -> None:
    clock = Clock()
    out = io.StringIO()
    display = ProgressDisplay(total_steps=100, stream=out, live=True, clock=clock)
    display.checkpoint(40, age_seconds=90)
    clock.now += 5
    display.update(step=41, loss=1.0)
    assert _shown(out) == [(41, 40, 95)]


def test_non_live_output_prints_every_interval() -> None:
    clock = Clock()
    out = io.StringIO()
    display = ProgressDisplay(
        total_steps=100, stream=out, live=False, every_seconds=5.0, clock=clock
    )
    display.checkpoint(1)
    for step in range(2, 12):
        clock.now += 1
        display.update(step=step, loss=1.0)
    # printed at the first update, then once 5 s had passed since the last print
    assert _shown(out) == [(2, 1, 1), (7, 1, 6)]


@pytest.mark.slow
def test_demo_progress_line_ages_until_the_next_checkpoint(tmp_path: Path) -> None:
    """`runner demo --progress`: after a SIGUSR1 checkpoint and no further commit, the line
    shows the age growing past 0 s (it used to be reset at every step)."""
    proc = subprocess.Popen(
        # a later --progress overrides the helper's --no-progress
        demo_cmd(tmp_path / "run", "--progress", steps=100000, ckpt_every=0),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    chunks: list[bytes] = []

    def read() -> None:
        assert proc.stderr is not None
        fd = proc.stderr.fileno()
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def text() -> str:
        return b"".join(chunks).decode("utf-8", "replace")

    def wait_for(pattern: str, timeout: float = 60.0) -> re.Match[str]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            match = re.search(pattern, text())
            if match:
                return match
            assert proc.poll() is None, f"demo exited {proc.returncode}:\n{text()}"
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the demo's output:\n{text()[-3000:]}")

    try:
        wait_for(r"last checkpoint: none yet")
        proc.send_signal(signal.SIGUSR1)
        step = int(wait_for(r"last checkpoint: step (\d+) \(")[1])
        # No cadence, so no further commit: the age keeps growing with the wall clock.
        wait_for(rf"last checkpoint: step {step} \(([2-9]|\d\d+)s ago\)", timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75, text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(5)
    # the final checkpoint (on SIGTERM) is committed after the last progress line
    ages = [
        (int(s), int(a)) for s, a in re.findall(r"last checkpoint: step (\d+) \((\d+)s ago", text())
    ]
    assert all(s == step for s, _ in ages)
    assert [a for _, a in ages] == sorted(a for _, a in ages)
