"""The metrics endpoint can never hurt training: a real `runner demo` limited to 1,024 open
files keeps committing checkpoints while 1,500 idle connections sit on its metrics port, its
final checkpoint on SIGTERM is committed (exit 75), malformed requests leave no traceback in
its log, and `--metrics-host` binds (and logs) exactly the address asked for."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.checkpoint.verify import verify_dir
from runner.metrics.registry import RunnerMetrics
from runner.metrics.server import ServerLimits, serve_metrics
from tests.fixtures.demo_process import checkpoint_steps, demo_cmd, logged_steps, wait_for_step
from tests.fixtures.metrics_scrape import scrape, value
from tests.fixtures.prometheus import free_port

PROCESS_FD_LIMIT = 1024
IDLE_CONNECTIONS = 1500
BATCH = 5


def _limit_fds() -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_NOFILE, (PROCESS_FD_LIMIT, PROCESS_FD_LIMIT))


@contextlib.contextmanager
def demo(run_dir: Path, log: Path, *extra: str, fd_limit: bool = False) -> Iterator[Demo]:
    with log.open("w") as out:
        proc = subprocess.Popen(
            demo_cmd(run_dir, *extra, steps=1_000_000, ckpt_every=10),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_limit_fds if fd_limit else None,
        )
    try:
        yield Demo(proc, run_dir, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


class Demo:
    def __init__(self, proc: subprocess.Popen[str], run_dir: Path, log: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.output())
            if found:
                return found
            assert self.proc.poll() is None, self.output()
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the log:\n{self.output()}")

    def wait_for_checkpoint_after(self, step: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            newer = [s for s in checkpoint_steps(self.run_dir) if s > step]
            if newer:
                return newer[-1]
            assert self.proc.poll() is None, self.output()
            time.sleep(0.05)
        raise AssertionError(f"no checkpoint after step {step} in {timeout}s:\n{self.output()}")

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def _verified(run_dir: Path, step: int) -> None:
    manifest = verify_dir(run_dir / "checkpoints" / f"step_{step:06d}")
    assert manifest.step == step


@pytest.fixture
def many_fds() -> Iterator[None]:
    """This test process needs a descriptor per idle connection, and then some."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = IDLE_CONNECTIONS + 512
    assert hard == resource.RLIM_INFINITY or hard >= wanted, f"hard RLIMIT_NOFILE {hard}"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_idle_connections(port: int, count: int) -> tuple[list[socket.socket], int]:
    """`count` TCP connections that never send a byte, opened as an attacker would: a batch
    at a time, each batch given up to 3 s to complete its handshakes before the next. Returns
    the sockets and how many completed (a server that stops accepting leaves the rest in
    SYN retries)."""
    socks: list[socket.socket] = []
    established = 0
    for start in range(0, count, BATCH):
        batch = []
        for _ in range(min(BATCH, count - start)):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            batch.append(sock)
        socks += batch
        with selectors.DefaultSelector() as waiting:
            for sock in batch:
                waiting.register(sock, selectors.EVENT_WRITE)
            deadline = time.monotonic() + 3
            while waiting.get_map() and time.monotonic() < deadline:
                for key, _ in waiting.select(timeout=max(0.0, deadline - time.monotonic())):
                    waiting.unregister(key.fileobj)
                    sock = key.fileobj  # type: ignore[assignment]
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                        established += 1
    return socks, established


@pytest.mark.slow
def test_idle_connection_flood_does_not_stop_checkpoints_or_the_final_save(
    tmp_path: Path, many_fds: None
) -> None:
    # Against a server that accepts every connection and never times one out, the 1,500
    # connections take all 1,024 descriptors and every checkpoint after them fails (EMFILE).
    run_dir, port = tmp_path / "run", free_port()
    with demo(run_dir, tmp_path / "demo.log", "--metrics-port", str(port), fd_limit=True) as d:
        # The default bind address, stated as it is.
        d.wait_for_log(rf"metrics served on 0\.0\.0\.0:{port} \(every IPv4 interface")
        d.wait_for_checkpoint_after(0)
        with open(f"/proc/{d.proc.pid}/limits") as limits:
            assert re.search(r"Max open files\s+1024\s+1024", limits.read())
        before = d.open_fds()
        flood, established = open_idle_connections(port, IDLE_CONNECTIONS)
        try:
            flooded_at = max(logged_steps(run_dir))
            during = d.open_fds()
            # The server's own budget: 32 connections, plus ones dropped but not yet closed.
            assert during - before <= 2 * 32 + 8, (before, during)

            # Checkpoints keep committing: two new ones, each verifying.
            first = d.wait_for_checkpoint_after(flooded_at)
            _verified(run_dir, first)
            second = d.wait_for_checkpoint_after(first)
            _verified(run_dir, second)

            # /metrics answers with current values while the connections are still open.
            sample = scrape(port)
            assert sample is not None, "no /metrics answer during the flood"
            train_step = value(sample, "runner_train_step")
            assert train_step is not None and train_step >= second
            local = value(sample, "runner_checkpoint_last_step", location="local")
            assert local is not None and local >= second
            assert value(sample, "runner_checkpoint_failures_total", stage="save") == 0
            # Every connection got through the handshake: the server kept accepting (and
            # dropping the oldest idle ones), it did not just stop listening.
            assert established == IDLE_CONNECTIONS
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                assert r.status == 200

            # SIGTERM with the flood still open: the final checkpoint is committed.
            assert d.stop() == 75, d.output()
        finally:
            for sock in flood:
                sock.close()
        output = d.output()
        final = max(logged_steps(run_dir))
        assert checkpoint_steps(run_dir)[-1] == final
        _verified(run_dir, final)
        assert f"checkpoint step {final} committed" in output
        assert "could not be written" not in output
        assert "Too many open files" not in output
        assert "Traceback" not in output
        # Rate-limited: one line per kind of trouble per minute, this test is shorter.
        warnings = [line for line in output.splitlines() if "metrics server:" in line]
        assert 1 <= len(warnings) <= 5, warnings


def _send_and_hang_up(port: int, data: bytes, *, reset: bool) -> bytes:
    """Send `data`; with `reset`, abort the connection (RST) instead of reading the reply."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return b""
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


@pytest.mark.slow
def test_malformed_requests_leave_one_warning_line_and_no_traceback(tmp_path: Path) -> None:
    run_dir, port = tmp_path / "run", free_port()
    with demo(run_dir, tmp_path / "demo.log", "--metrics-port", str(port)) as d:
        d.wait_for_log(rf"metrics served on 0\.0\.0\.0:{port}")
        wait_for_step(d.proc, run_dir, 5)

        # Half a request line, then silence: closed at the server's 10 s read deadline.
        silent = socket.create_connection(("127.0.0.1", port), timeout=30)
        silent.sendall(b"GET /metr")
        started = time.monotonic()

        for _ in range(20):  # garbage, many times: still one warning line
            reply = _send_and_hang_up(port, b"\x00\x01\xff garbage \x16\x03\r\n\r\n", reset=False)
            assert reply.startswith(b"HTTP/1.1 400 "), reply[:80]
        huge = b"GET /metrics HTTP/1.1\r\n" + b"".join(
            b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000) for i in range(90)
        )
        reply = _send_and_hang_up(port, huge + b"\r\n", reset=False)
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:80]
        long_line = b"GET /metrics HTTP/1.1\r\nX-Long: " + b"b" * 70000 + b"\r\n\r\n"
        reply = _send_and_hang_up(port, long_line, reset=False)
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:80]
        # A client that resets in the middle of its headers, and one after its request.
        _send_and_hang_up(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n", reset=True)
        for _ in range(5):
            _send_and_hang_up(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", reset=True)

        assert silent.recv(100) == b""  # the server hung up on it
        waited = time.monotonic() - started
        assert 9 <= waited <= 20, waited
        silent.close()

        sample = scrape(port)
        assert sample is not None and value(sample, "runner_train_step") is not None
        assert d.stop() == 75, d.output()
    output = d.output()
    assert "Traceback" not in output
    assert 'File "' not in output
    warnings = [line for line in output.splitlines() if "metrics server:" in line]
    # One line per kind (bad request, connection error, deadline), however many happened.
    assert sum("bad request from 127.0.0.1: code 400" in w for w in warnings) == 1, warnings
    assert sum("closed a connection from 127.0.0.1 at its deadline" in w for w in warnings) == 1
    assert len(warnings) <= 3, warnings
    assert all(len(w) < 400 for w in warnings), warnings
    assert "b" * 300 not in output  # the raw request is never echoed at length


def _other_local_addresses() -> list[str]:
    """Addresses of this machine other than 127.0.0.1: 127.0.0.2 (all of 127/8 is local on
    Linux) and the address of the interface a default route would use, if any."""
    found = ["127.0.0.2"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe, contextlib.suppress(OSError):
        probe.connect(("198.51.100.1", 9))  # UDP connect: picks a route, sends nothing
        address = probe.getsockname()[0]
        if not address.startswith("127."):
            found.append(address)
    return found


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except ConnectionRefusedError:
        return False


@pytest.mark.slow
def test_metrics_host_loopback_is_logged_and_refuses_other_addresses(tmp_path: Path) -> None:
    run_dir, port = tmp_path / "run", free_port()
    extra = ("--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    with demo(run_dir, tmp_path / "demo.log", *extra) as d:
        d.wait_for_log(rf"metrics served on 127\.0\.0\.1:{port} \(this machine only")
        assert _connects("127.0.0.1", port)
        others = _other_local_addresses()
        for address in others:
            assert not _connects(address, port), address
        assert d.stop() == 75, d.output()
    assert "0.0.0.0" not in d.output()


def test_runner_run_takes_metrics_host_from_the_environment(tmp_path: Path) -> None:
    port = free_port()
    trainer = [sys.executable, "-c", "import time; time.sleep(120)"]
    env = {**os.environ, "RUNNER_METRICS_HOST": "::1", "RUNNER_METRICS_PORT": str(port)}
    log = tmp_path / "run.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runner", "run", "--run-dir", str(tmp_path / "run"), "--",
             *trainer],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while f"metrics served on [::1]:{port} (this machine only" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        with urllib.request.urlopen(f"http://[::1]:{port}/healthz", timeout=5) as response:
            assert response.status == 200
        assert not _connects("127.0.0.1", port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.slow
def test_ipv6_wildcard_and_brackets_bind_and_a_foreign_address_is_a_clear_error(
    tmp_path: Path,
) -> None:
    with serve_metrics(RunnerMetrics(), host="[::1]", port=None) as server:
        assert (server.host, server.bind_address) == ("::1", f"[::1]:{server.port}")
        with urllib.request.urlopen(f"{server.url}/healthz", timeout=5) as response:
            assert response.status == 200
    with serve_metrics(RunnerMetrics(), host="::", port=None) as server:
        assert (server.bind_address, server.scope) == (f"[::]:{server.port}", "every interface")
        with urllib.request.urlopen(f"http://[::1]:{server.port}/healthz", timeout=5) as r:
            assert r.status == 200

    # An address that is not this machine's: exit 2, one line naming it, no traceback.
    port = free_port()
    done = subprocess.run(
        demo_cmd(tmp_path / "run", "--metrics-port", str(port), "--metrics-host", "198.51.100.7"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot serve metrics on 198.51.100.7:{port}: Cannot assign requested address" in (
        done.stderr
    )
    assert "Traceback" not in done.stderr


def test_an_overlong_request_line_gets_414_and_one_warning_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The head cap applies to the request line too; http.server answers only header lines.
    request = b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n"
    with (
        serve_metrics(RunnerMetrics(), host="127.0.0.1", port=None) as server,
        caplog.at_level(logging.WARNING, logger="runner"),
    ):
        reply = _send_and_hang_up(server.port, request, reset=False)
        assert reply.startswith(b"HTTP/1.1 414 "), reply[:80]
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as r:
            assert r.status == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "414" in warnings[0], warnings
    assert "Traceback" not in caplog.text


def test_a_refused_oversized_head_still_reaches_a_client_that_is_still_sending() -> None:
    # The server answers 431 after 16 KiB while the client is still sending the rest: closing
    # on the unread bytes would reset the connection and destroy the reply (seen under load).
    with serve_metrics(RunnerMetrics(), host="127.0.0.1", port=None) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Long: " + b"b" * 20_000)
            time.sleep(0.3)  # the server has answered and finished with the request by now
            sock.sendall(b"b" * 50_000 + b"\r\n\r\n")
            time.sleep(0.1)
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        finally:
            sock.close()
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:80]


@pytest.mark.slow
def test_a_trickling_request_is_cut_at_the_deadline_not_kept_alive_by_each_byte() -> None:
    # Slowloris: one byte every 0.2 s never trips a per-recv timeout; the deadline covers the
    # whole request head.
    limits = ServerLimits(max_connections=4, read_timeout_s=1.5)
    with serve_metrics(RunnerMetrics(), host="127.0.0.1", port=None, limits=limits) as server:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        started = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"z" * 200:
                sock.send(bytes([byte]))
                time.sleep(0.2)
                if time.monotonic() - started > 8:
                    break
        sock.settimeout(10)
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(100) == b""
        assert time.monotonic() - started < 6
        sock.close()


def test_at_the_connection_limit_the_oldest_idle_one_makes_room_for_a_scrape() -> None:
    limits = ServerLimits(max_connections=4)
    with serve_metrics(RunnerMetrics(), host="127.0.0.1", port=None, limits=limits) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(40)]
        try:
            for _ in range(3):
                with urllib.request.urlopen(f"{server.url}/healthz", timeout=5) as response:
                    assert response.status == 200
            tracked = len(server._httpd._conns)
            assert tracked <= 2 * limits.max_connections, tracked
            # The first idle connections were hung up on to make room.
            idle[0].settimeout(5)
            assert idle[0].recv(10) == b""
        finally:
            for sock in idle:
                sock.close()
