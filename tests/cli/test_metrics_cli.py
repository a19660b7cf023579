"""Scrape the metrics of a running `runner run` (and `runner demo`) while it checkpoints:
the age resets, the step advances, and upload failures count while the bucket is
unreachable."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlparse

import pytest

from tests.fixtures.metrics_scrape import Sample, scrape, value

# A seed-format trainer (DESIGN.md, Supervisor): 4 parameters, a step every 0.2 s, a
# step_NNNNNN.bin every 5 steps, written under a temp name and renamed. It stops at a step
# boundary once the stop file exists, writing a final checkpoint first.
TRAINER = """
import os, struct, sys, time
from pathlib import Path

stop_file, ckpt_dir = Path(sys.argv[1]), Path(os.environ["RUNNER_CKPT_DIR"])
step = 0
resume = os.environ.get("RUNNER_RESUME_FROM", "")
if resume:
    path = Path(resume)
    path = path if path.is_file() else next(path.glob("step_*.bin"))
    step = struct.unpack("<i", path.read_bytes()[:4])[0]

def save(step):
    body = struct.pack("<ii", step, 4) + struct.pack("<12f", *[float(step)] * 12)
    tmp = ckpt_dir / f".tmp-step_{step:06d}.bin"
    tmp.write_bytes(body)
    os.replace(tmp, ckpt_dir / f"step_{step:06d}.bin")

while not stop_file.exists():
    time.sleep(0.2)
    step += 1
    if step % 5 == 0:
        save(step)
if step % 5:
    save(step)
"""
SEED_BIN_BYTES = 8 + 12 * 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Scraper:
    """Scrapes every 0.1 s and keeps every sample, so a test can assert on the sequence."""

    def __init__(self, port: int, process: subprocess.Popen[bytes]) -> None:
        self.port = port
        self.process = process
        self.samples: list[Sample] = []

    def until(self, what: str, done: Callable[[Sample], bool], timeout: float) -> Sample:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"runner exited with {self.process.returncode} waiting for {what}")
            sample = scrape(self.port)
            if sample is not None:
                self.samples.append(sample)
                if done(sample):
                    return sample
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout}s waiting for {what}")

    def series(self, name: str, **labels: str) -> list[float | None]:
        return [value(s, name, **labels) for s in self.samples]


def assert_age_resets_at_each_checkpoint(scraper: Scraper, location: str) -> None:
    steps = scraper.series("runner_checkpoint_last_step", location=location)
    ages = scraper.series("runner_checkpoint_age_seconds", location=location)
    points = list(zip(steps, ages, strict=True))
    pairs = list(itertools.pairwise(points))
    # Between checkpoints the age grows at scrape time...
    assert any(s0 == s1 and s0 is not None and a1 > a0 for (s0, a0), (s1, a1) in pairs)
    # ...and a new checkpoint (the step advances) sets it back.
    resets = [(a0, a1) for (s0, a0), (s1, a1) in pairs if s1 is not None and (s0 or 0) < s1]
    assert resets and any(a1 < a0 for a0, a1 in resets), list(zip(steps, ages, strict=True))


class CuttableLink:
    """Fault injector: a TCP relay to the real S3 server whose link can be cut (new
    connections refused, open ones reset) and restored on the same port. A real server
    cannot be made to vanish mid-run and come back at the same address."""

    def __init__(self, endpoint: str) -> None:
        parsed = urlparse(endpoint)
        self._target = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
            listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown() wakes the thread blocked in accept(); close() alone leaves the
            # socket listening until that call returns.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                return
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


@pytest.mark.slow
@pytest.mark.e2e
def test_run_metrics_follow_checkpoints_and_count_failures_while_the_s3_link_is_cut(
    s3_server, tmp_path
):
    bucket = s3_server.create_bucket()
    link = CuttableLink(s3_server.endpoint)
    (tmp_path / "trainer.py").write_text(TRAINER)
    stop_file = tmp_path / "stop"
    port = free_port()
    env = {**os.environ, **s3_server.env(), "AWS_ENDPOINT_URL_S3": link.url}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "run",
            "--run-dir",
            str(tmp_path / "run"),
            "--mirror",
            f"s3://{bucket}/run",
            "--metrics-port",
            str(port),
            "--",
            sys.executable,
            str(tmp_path / "trainer.py"),
            str(stop_file),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "runner.log").open("wb"),
    )
    scraper = Scraper(port, process)
    try:
        # Link up: checkpoints are committed and mirrored.
        def local_steps() -> list[float]:
            steps = scraper.series("runner_checkpoint_last_step", location="local")
            return [step for step in steps if step is not None]

        first = scraper.until(
            "three local checkpoints seen and two mirrored",
            lambda s: (
                len(set(local_steps())) >= 3
                and (value(s, "runner_checkpoint_last_step", location="remote") or 0) >= 10
            ),
            timeout=90,
        )
        assert value(first, "runner_checkpoint_failures_total", stage="upload") == 0
        assert value(first, "runner_checkpoint_bytes") == SEED_BIN_BYTES
        assert value(first, "runner_train_step") == value(
            first, "runner_checkpoint_last_step", location="local"
        )
        assert (value(first, "runner_checkpoint_save_duration_seconds_count") or 0) >= 3
        assert (value(first, "runner_checkpoint_upload_duration_seconds_count") or 0) >= 2
        assert local_steps() == sorted(local_steps())
        assert all(step % 5 == 0 for step in local_steps())
        assert_age_resets_at_each_checkpoint(scraper, "local")
        assert_age_resets_at_each_checkpoint(scraper, "remote")

        # Link cut: training and local checkpoints go on; uploads fail and are counted.
        link.cut()
        cut = scraper.samples[-1]
        remote_at_cut = value(cut, "runner_checkpoint_last_step", location="remote")
        local_at_cut = value(cut, "runner_checkpoint_last_step", location="local")
        failing = scraper.until(
            "an upload failure",
            lambda s: (value(s, "runner_checkpoint_failures_total", stage="upload") or 0) >= 1,
            timeout=90,
        )
        # A checkpoint that was mid-upload at the cut may still land; nothing after it does.
        remote_frozen = value(failing, "runner_checkpoint_last_step", location="remote")
        assert remote_frozen is not None and remote_at_cut is not None
        assert remote_frozen <= remote_at_cut + 5
        assert (value(failing, "runner_checkpoint_last_step", location="local") or 0) > (
            local_at_cut or 0
        )
        assert (value(failing, "runner_checkpoint_age_seconds", location="remote") or 0) > (
            value(failing, "runner_checkpoint_age_seconds", location="local") or 0
        )
        assert value(failing, "runner_checkpoint_failures_total", stage="save") == 0

        # Link restored: the mirror catches up by itself.
        link.restore()
        scraper.until(
            "the mirror to catch up",
            lambda s: (
                (value(s, "runner_checkpoint_last_step", location="remote") or 0) > remote_frozen
            ),
            timeout=90,
        )
        stop_file.touch()
        assert process.wait(timeout=60) == 0, (tmp_path / "runner.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        link.cut()


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_metrics_follow_checkpoints(tmp_path):
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "demo",
            "--run-dir",
            str(tmp_path / "run"),
            "--mirror",
            f"file://{tmp_path / 'bucket'}",
            # A clock cadence (not every N steps): however fast the machine, each checkpoint
            # stays the newest for ~1 s, several scrapes long.
            "--steps",
            "1000000",
            "--ckpt-every",
            "0",
            "--ckpt-every-seconds",
            "1",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--metrics-port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "demo.log").open("wb"),
    )
    scraper = Scraper(port, process)
    try:
        first = scraper.until(
            "a checkpoint in the mirror",
            lambda s: (value(s, "runner_checkpoint_last_step", location="remote") or 0) > 0,
            timeout=180,
        )
        first_remote = value(first, "runner_checkpoint_last_step", location="remote") or 0
        last = scraper.until(
            "a second checkpoint in the mirror",
            lambda s: (
                (value(s, "runner_checkpoint_last_step", location="remote") or 0) > first_remote
            ),
            timeout=180,
        )
        steps = [step for step in scraper.series("runner_train_step") if step is not None]
        assert steps == sorted(steps) and steps[-1] > first_remote
        local = [s for s in scraper.series("runner_checkpoint_last_step", location="local") if s]
        assert local == sorted(local) and len(set(local)) >= 2
        assert_age_resets_at_each_checkpoint(scraper, "local")
        assert value(last, "runner_checkpoint_failures_total", stage="save") == 0
        assert value(last, "runner_checkpoint_failures_total", stage="upload") == 0
        assert (value(last, "runner_checkpoint_bytes") or 0) > 0
        assert (value(last, "runner_checkpoint_save_duration_seconds_count") or 0) >= 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=180) == 75, (tmp_path / "demo.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
