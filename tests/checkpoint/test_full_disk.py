"""A real full disk (a small tmpfs): the failed save leaves the last good checkpoint intact,
no partial files, a clear message, and training goes on until the final save fails; a failed
loss.jsonl append is reported, leaves no torn line, and the lines reach the file once space
returns."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.verify import verify_dir
from tests.fixtures.async_saves import mounted_tmpfs as tmpfs
from tests.fixtures.demo_process import (
    checkpoint_steps,
    demo_cmd,
    manifest,
    run_demo,
    wait_for_step,
)
from tests.fixtures.metrics_scrape import scrape, value
from tests.fixtures.prometheus import free_port


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    # Room for one demo checkpoint (1.4 MB) but not two: the second save hits ENOSPC.
    with tmpfs(tmp_path / "disk", "2500k") as mount_point:
        yield mount_point


def fill(path: Path) -> int:
    """Write zeros into `path` until the filesystem is full; returns the bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    written = 0
    chunk = b"\0" * 4096
    try:
        while True:
            try:
                written += os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return written
    finally:
        os.close(fd)


@pytest.mark.slow
def test_full_disk_keeps_the_last_good_checkpoint_and_says_what_to_do(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    done = run_demo(run_dir, steps=6, ckpt_every=2)
    assert done.returncode == 1, done.stderr
    assert "checkpoint at step 4 could not be written" in done.stderr
    assert "No space left on device" in done.stderr
    assert "step 2 is intact" in done.stderr
    assert "training continues" in done.stderr  # the periodic failure did not stop the run
    assert "checkpoint at step 6 could not be written" in done.stderr  # the final one failed
    assert "Traceback" not in done.stderr
    assert checkpoint_steps(run_dir) == [2]
    verify_dir(run_dir / "checkpoints" / "step_000002")
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []


def _lines(path: Path) -> list[dict[str, object]]:
    """Every line of loss.jsonl, each of which must be one complete JSON object."""
    raw = path.read_bytes()
    assert raw.endswith(b"\n")
    return [json.loads(line) for line in raw.decode().split("\n")[:-1]]


def test_loss_log_on_a_full_disk_holds_its_lines_and_leaves_no_torn_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failures: list[int] = []
    with tmpfs(tmp_path / "disk", "64k") as disk:
        loss_log = LossLog(disk, attempt="a1", on_failure=lambda: failures.append(1))
        with caplog.at_level(logging.INFO, logger="runner.checkpoint.loss_log"), loss_log:
            loss_log.append(1, 1.0)
            fill(disk / "filler")
            size_full = (disk / "loss.jsonl").stat().st_size
            # Lines go on fitting in the file's last page; the one that crosses into a new
            # page is written in part by the kernel, then ENOSPC: that part must be cut back.
            step = 1
            while not failures:
                step += 1
                assert step < 200, "the full disk never refused an append"
                loss_log.append(step, 1.0 / step)  # never raises
            first_failed = step
            for step in range(first_failed + 1, first_failed + 6):
                loss_log.append(step, 1.0 / step)
            loss_log.sync()  # never raises either; one more failed attempt
            assert len(failures) == 1 + 5 + 1
            assert loss_log.pending_lines == first_failed + 5 - (first_failed - 1)
            on_disk = _lines(disk / "loss.jsonl")
            assert [r["step"] for r in on_disk] == list(range(1, first_failed))
            assert (disk / "loss.jsonl").stat().st_size <= size_full + 4096

            (disk / "filler").unlink()  # space returns
            last = first_failed + 6
            loss_log.append(last, 1.0 / last)
            loss_log.sync()
            loss_log.close()
        assert len(failures) == 7  # nothing failed after the space came back
        records = _lines(disk / "loss.jsonl")
        assert [r["step"] for r in records] == list(range(1, last + 1))
        assert [r["loss"] for r in records] == [1.0] + [1.0 / s for s in range(2, last + 1)]
        assert all(r["attempt"] == "a1" for r in records)
        assert LossLog(disk).read() == {1: 1.0, **{s: 1.0 / s for s in range(2, last + 1)}}
    errors = [r for r in caplog.records if "could not append" in r.getMessage()]
    recoveries = [r for r in caplog.records if "appending again" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR  # once per streak
    assert "No space left on device" in errors[0].getMessage()
    assert len(recoveries) == 1
    assert "after 7 failed attempt(s)" in recoveries[0].getMessage()
    assert "nothing lost" in recoveries[0].getMessage()


@pytest.mark.slow
def test_demo_on_a_full_disk_keeps_its_loss_history_and_checkpoints_once_space_returns(
    tmp_path: Path,
) -> None:
    steps = 400
    port = free_port()
    with tmpfs(tmp_path / "disk", "8m") as disk:
        run_dir = disk / "run"
        proc = subprocess.Popen(
            demo_cmd(run_dir, "--metrics-port", str(port), "--keep", "2", steps=steps,
                     ckpt_every=100),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.extend(proc.stderr or ()), daemon=True)
        reader.start()
        try:
            wait_for_step(proc, run_dir, 110)
            fill(disk / "filler")
            # The disk stays full while the demo fails at least 5 appends in a row.
            deadline = time.monotonic() + 60
            failed = 0.0
            while failed < 5:
                assert time.monotonic() < deadline, "".join(err)
                assert proc.poll() is None, "".join(err)
                sample = scrape(port)
                if sample is not None:
                    failed = (
                        value(sample, "runner_checkpoint_failures_total", stage="loss_log") or 0
                    )
                time.sleep(0.05)
            (disk / "filler").unlink()
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(10)
        stderr = "".join(err)
        assert code == 0, stderr
        assert "Traceback" not in stderr
        assert stderr.count("could not append") == 1, stderr  # one line for the whole streak
        assert stderr.count("appending again after") == 1, stderr
        assert "nothing lost" in stderr
        # Every line parses; every step is there once, in order, nothing lost or torn.
        records = _lines(run_dir / "loss.jsonl")
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        assert checkpoint_steps(run_dir)[-1] == steps
        final = run_dir / "checkpoints" / f"step_{steps:06d}"
        verify_dir(final)
        history = torch.load(final / "state.pt", weights_only=True)["loss_history"]
        assert [r["loss"] for r in records] == history


ROOM_LINE = re.compile(
    r"no room for checkpoint step (\d+) in \S+ \(No space left on device\): deleted step (\d+) "
    r"\(([\d.]+) MB freed\), the oldest checkpoint older than step (\d+), the newest "
    r"verified; the retry committed it$",
    re.MULTILINE,
)


@pytest.mark.slow
@pytest.mark.parametrize("save_mode", ["async", "sync"])
def test_demo_on_a_disk_that_holds_keep_checkpoints_goes_on_checkpointing_to_its_last_step(
    tmp_path: Path, save_mode: str
) -> None:
    # 4 MiB holds three 1.4 MB demo checkpoints and not a fourth: every save from step 20 on
    # finds the disk full, deletes the oldest of the three and commits on its retry.
    port = free_port()
    with tmpfs(tmp_path / "disk", "4m") as disk:
        run_dir = disk / "run"
        proc = subprocess.Popen(
            demo_cmd(run_dir, "--keep", "3", "--save-mode", save_mode, "--metrics-port",
                     str(port), "--metrics-host", "127.0.0.1", steps=60, ckpt_every=5),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.extend(proc.stderr or ()), daemon=True)
        reader.start()
        samples = []
        try:
            while proc.poll() is None:
                sample = scrape(port)
                if sample is not None:
                    samples.append(sample)
                time.sleep(0.005)
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reader.join(10)
        stderr = "".join(err)
        assert code == 0, stderr
        assert checkpoint_steps(run_dir) == [50, 55, 60]
        verified = subprocess.run(
            [sys.executable, "-m", "runner", "verify", str(run_dir)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert [line.split()[1] for line in verified.stdout.splitlines()] == ["60", "55", "50"]
        assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
        size_mb = manifest(run_dir, 60)["files"][0]["size"] / 1e6  # type: ignore[index]
    assert "Traceback" not in stderr
    assert "could not be written" not in stderr and "training continues" not in stderr
    rooms = [tuple(map(float, m)) for m in ROOM_LINE.findall(stderr)]
    # one line per save from step 20 on: the oldest of three deleted, the newest verified kept
    assert [(int(s), int(d), int(n)) for s, d, _f, n in rooms] == [
        (step, step - 15, step - 5) for step in range(20, 65, 5)
    ], stderr
    assert all(abs(freed - size_mb) < 0.1 for _s, _d, freed, _n in rooms), rooms
    # every scrape: the saves 20 .. last committed step each failed once; the next save's
    # first attempt may have failed already while its retry is still being written
    counted = [
        (int(value(s, "runner_checkpoint_last_step", location="local") or 0),
         value(s, "runner_checkpoint_failures_total", stage="save") or 0.0)
        for s in samples
    ]  # fmt: skip
    assert counted, "no scrape while the demo ran"
    for last, failures in counted:
        failed = max(0, (last - 15) // 5)  # the save of 20 is the first to find the disk full
        assert failures in (failed, failed + 1), (last, failures)
    assert any(20 <= last <= 55 for last, _ in counted), counted  # a count seen mid-run
