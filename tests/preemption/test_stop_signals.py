"""StopController semantics, and real signals delivered to a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runner.preemption.signals import install_signal_handlers
from runner.preemption.stop import StopController

REPO = Path(__file__).resolve().parents[2]


def test_first_reason_and_earliest_deadline_win() -> None:
    c = StopController(clock=lambda: 100.0)
    assert not c.stop_requested and c.reason is None and c.deadline is None
    c.request_stop("aws notice", deadline=200.0)
    c.request_stop("SIGTERM", deadline=150.0)
    c.request_stop("SIGTERM", deadline=None)
    c.request_stop("SIGINT", deadline=300.0)
    assert c.stop_requested
    assert c.reason == "aws notice"
    assert c.deadline == 150.0
    assert c.time_left() == 50.0
    assert c.stop_count == 4
    c.close()


def test_checkpoint_requests_collapse_until_taken() -> None:
    c = StopController()
    assert c.take_checkpoint_request() is None
    c.request_checkpoint("SIGUSR1")
    c.request_checkpoint("notice")
    assert c.checkpoint_pending
    assert c.take_checkpoint_request() == "notice"
    assert c.take_checkpoint_request() is None
    assert not c.stop_requested
    c.close()


def test_wait_returns_when_another_thread_requests_stop() -> None:
    c = StopController()
    assert c.wait(0.05) is False
    timer = threading.Timer(0.1, c.request_stop, args=("test",), kwargs={"deadline": 5.0})
    start = time.monotonic()
    timer.start()
    assert c.wait(5.0) is True
    assert time.monotonic() - start < 1.0
    assert c.wait_any(0) is True
    c.close()


def test_wait_any_wakes_on_checkpoint_request() -> None:
    c = StopController()
    threading.Timer(0.05, c.request_checkpoint, args=("SIGUSR1",)).start()
    assert c.wait_any(5.0) is True
    assert not c.stop_requested
    c.close()


def test_concurrent_requests_keep_the_earliest_deadline() -> None:
    c = StopController()
    deadlines = [float(d) for d in range(1000, 0, -1)]

    def worker(chunk: list[float]) -> None:
        for d in chunk:
            c.request_stop("t", deadline=d)

    threads = [threading.Thread(target=worker, args=(deadlines[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.deadline == 1.0
    assert c.stop_count == 1000
    c.close()


def test_handlers_set_state_and_restore_previous_handlers() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    c = StopController()
    restore = install_signal_handlers(c, grace_seconds=10.0)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert c.wait_any(2.0)
        assert c.take_checkpoint_request() == "SIGUSR1"
        assert not c.stop_requested
        now = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
        assert c.wait(2.0)
        assert c.reason == "SIGINT"
        deadline = c.deadline
        assert deadline is not None and now + 9.0 < deadline <= time.monotonic() + 10.0
    finally:
        restore(force=True)  # after a stop a plain restore() keeps ignoring (test_signal_edges)
        c.close()
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.slow
def test_signal_storm_while_main_thread_waits_does_not_deadlock() -> None:
    """SIGUSR1 delivered hundreds of times while the main thread is inside wait_any and
    another thread also posts requests: the handler takes no lock, so nothing hangs."""
    c = StopController()
    restore = install_signal_handlers(c)
    stop_storm = threading.Event()

    def storm() -> None:
        while not stop_storm.is_set():
            os.kill(os.getpid(), signal.SIGUSR1)
            c.request_checkpoint("thread")
            time.sleep(0.0005)

    sender = threading.Thread(target=storm)
    sender.start()
    taken = 0
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            if c.wait_any(0.01) and c.take_checkpoint_request() is not None:
                taken += 1
    finally:
        stop_storm.set()
        sender.join()
        restore()
        c.close()
    assert taken > 10


def _spawn_stop_loop(out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.trainers.stop_loop", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _read_until(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process ended before printing {prefix!r}")
        if line.startswith(prefix):
            return line.strip()


@pytest.mark.slow
def test_real_process_sigusr1_checkpoints_and_keeps_going(tmp_path: Path) -> None:
    proc = _spawn_stop_loop(tmp_path)
    try:
        proc.send_signal(signal.SIGUSR1)
        line = _read_until(proc, "checkpoint ")
        first_step = int(line.split()[1])
        time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        second_step = int(_read_until(proc, "checkpoint ").split()[1])
        assert second_step > first_step  # it kept training between the two
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _read_until(proc, "saved ")
        assert proc.wait(10) == 75
    finally:
        proc.kill()
        proc.wait()
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == [
        f"ckpt_{first_step:06d}",
        f"ckpt_{second_step:06d}",
    ]


@pytest.mark.slow
def test_second_sigterm_during_final_save_neither_aborts_nor_corrupts(tmp_path: Path) -> None:
    proc = _spawn_stop_loop(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _read_until(proc, "saving ")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
            time.sleep(0.1)
            proc.send_signal(sig)
        saved = _read_until(proc, "saved ")
        assert proc.wait(10) == 75
    finally:
        proc.kill()
        proc.wait()
    assert saved.endswith("stops=4 reason=SIGTERM")
    assert (tmp_path / "final.bin").read_bytes() == b"".join(bytes([i]) * 1000 for i in range(20))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_install_outside_main_thread_is_refused() -> None:
    from runner.errors import ConfigError

    errors: list[BaseException] = []

    def target() -> None:
        try:
            install_signal_handlers(StopController())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=target)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], ConfigError)


@pytest.mark.parametrize("timeout", [0.0, 0.05])
def test_wait_times_out_without_requests(timeout: float) -> None:
    c = StopController()
    start = time.monotonic()
    assert c.wait(timeout) is False
    assert time.monotonic() - start < timeout + 0.5
    c.close()
