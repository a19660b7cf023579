"""Every store call has a bounded time: CLI commands against a store that never answers or
answers slow 500s give up within --store-timeout (plus process start-up), saying why on one
line; waits never pass a caller's deadline; a slow but moving transfer is never cut.

The failing stores are fakes (loopback servers written here): no real server answers 500s
on demand or stops answering forever. The transfer test runs against the real SeaweedFS
behind a bandwidth-limited relay."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.errors import StorageTimeoutError, StorageTransientError
from runner.storage.retry import RetryPolicy, store_deadline
from runner.storage.s3 import S3Storage
from runner.storage.s3_transfer import MiB, TransferSettings
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.fake_store import START_MARGIN_S, FakeStore, env_for
from tests.fixtures.s3 import SeaweedS3


@pytest.fixture
def silent_store() -> Iterator[FakeStore]:
    store = FakeStore("hang")
    yield store
    store.close()


@pytest.fixture
def slow_500_store() -> Iterator[FakeStore]:
    store = FakeStore("slow-500", delay=1.0)
    yield store
    store.close()


def timed_runner(
    *args: str | Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return result, time.monotonic() - started


def the_error_line(result: subprocess.CompletedProcess[str]) -> str:
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("runner: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


# -- CLI give-up times ---------------------------------------------------------------------


@pytest.mark.slow
def test_fake_silent_store_ls_gives_up_within_the_store_timeout(silent_store: FakeStore) -> None:
    result, took = timed_runner(
        "ls", "s3://bucket/run", "--store-timeout", "6", env=env_for(silent_store.endpoint)
    )
    assert result.returncode == 1, result.stderr
    assert took <= 6 + START_MARGIN_S, took
    line = the_error_line(result)
    assert "list s3://bucket/run/checkpoints/: gave up after" in line
    assert "store timeout 6 s" in line and "--store-timeout" in line
    assert "Read timeout" in line and "AWS_ENDPOINT_URL_S3" in line  # what to check
    assert silent_store.requests >= 1


@pytest.mark.slow
def test_fake_slow_500_store_ls_gives_up_within_the_store_timeout(
    slow_500_store: FakeStore,
) -> None:
    result, took = timed_runner(
        "ls", "s3://bucket/run", env=env_for(slow_500_store.endpoint, RUNNER_STORE_TIMEOUT="8")
    )
    assert result.returncode == 1, result.stderr
    assert took <= 8 + START_MARGIN_S, took
    line = the_error_line(result)
    assert "gave up after" in line and "store timeout 8 s" in line
    assert "server answered 500 InternalError" in line
    # botocore's 2 tries of the first request (all that fit in 8 s), each answered 1 s late
    assert slow_500_store.requests >= 2


@pytest.mark.slow
def test_fake_store_that_lists_but_fails_every_read_costs_ls_one_timeout_not_one_each() -> None:
    """The listing names 5 checkpoints and every manifest read is answered 500 after 1 s: the
    first read gives up after the store timeout, the other 4 are not tried."""
    keys = [f"run/checkpoints/step_{n:06d}/manifest.json" for n in range(1, 6)]
    store = FakeStore("slow-500", delay=1.0, listing=keys)
    try:
        result, took = timed_runner(
            "ls", "s3://bucket/run", "--store-timeout", "6", env=env_for(store.endpoint)
        )
    finally:
        store.close()
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert took <= 6 + START_MARGIN_S, (took, output)  # was 5 x the budget
    assert output.count("gave up after") == 1, output
    assert output.count("not tried, the store already failed this command") == 4, output


@pytest.mark.slow
def test_fake_store_failing_every_read_fast_costs_ls_one_retry_cycle() -> None:
    """Every read is answered 500 at once, so the first read uses up its tries long before
    the (default, 60 s) store timeout: that too fails the command, and the other 7 reads are
    not tried (before: one full retry cycle per checkpoint)."""
    keys = [f"run/checkpoints/step_{n:06d}/manifest.json" for n in range(1, 9)]
    store = FakeStore("slow-500", delay=0.0, listing=keys)
    try:
        result, took = timed_runner("ls", "s3://bucket/run", env=env_for(store.endpoint))
    finally:
        store.close()
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert output.count("gave up after") == 1, output
    assert "(all 5 tries failed within the store timeout 60 s)" in output, output
    assert output.count("not tried, the store already failed this command") == 7, output
    # 5 operation tries x 3 botocore tries, list included: 16 requests, not 8 x 15
    assert store.requests == 1 + 5 * 3, store.requests
    assert took <= 60 + START_MARGIN_S, (took, output)  # default store timeout: 60 s


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        ["verify", "{loc}"],
        ["status", "{loc}"],
        ["pull", "{loc}", "{tmp}/pulled"],
        ["push", "{tmp}/local", "{loc}"],
        ["prune", "{loc}", "--keep", "2"],
        ["fork", "{loc}", "{tmp}/forked"],
        ["repair", "{loc}"],
    ],
    ids=lambda c: c[0],
)
def test_fake_silent_store_every_store_command_gives_up_in_time(
    command: list[str], silent_store: FakeStore, tmp_path: Path
) -> None:
    make_checkpoint(tmp_path / "local", 10)
    args = [a.format(loc="s3://bucket/run", tmp=tmp_path) for a in command]
    result, took = timed_runner(*args, "--store-timeout", "4", env=env_for(silent_store.endpoint))
    assert result.returncode not in (0, 2, 3), result.stderr  # a store failure, exit 1
    assert took <= 4 + START_MARGIN_S, took
    line = the_error_line(result)
    assert "gave up after" in line and "store timeout 4 s" in line


@pytest.mark.parametrize(
    "seconds", [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 9.0, 12.0, 60.0, 86400.0]
)
def test_one_request_fits_in_every_store_timeout(seconds: float) -> None:
    """Even below the socket timeouts' floors (2 s connect, 1 s read) x 3 botocore tries."""
    settings = TransferSettings.for_store_timeout(seconds)
    assert settings.request_worst_s() <= seconds
    # as many botocore tries as fit: 3 from 9 s on (2 x 3 + 1 + 2 s of backoff)
    assert settings.request_attempts == (3 if seconds >= 9 else 2 if seconds >= 5 else 1)


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [1.0, 3.0, 6.0])
def test_fake_silent_store_small_store_timeout_holds(
    seconds: float, silent_store: FakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, 3 botocore tries at the socket floors made any store timeout up to 6 s last
    about 4.5-9 s."""
    for name, value in env_for(silent_store.endpoint).items():
        monkeypatch.setenv(name, value)
    store = S3Storage("bucket", "run", store_timeout_s=seconds)
    started = time.monotonic()
    with pytest.raises(StorageTimeoutError, match=f"store timeout {seconds:g} s"):
        store.head("checkpoints/step_000001/manifest.json")
    took = time.monotonic() - started
    assert took <= seconds + 1.0, took  # in-process: no start-up on top


# -- the retry loop's limits (in-process, a fake clock) -------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def failing(clock: FakeClock, *, takes: float) -> tuple[list[float], object]:
    starts: list[float] = []

    def attempt() -> None:
        starts.append(clock.now)
        clock.now += takes
        raise StorageTransientError("server answered 503")

    return starts, attempt


def test_retries_stop_when_one_more_try_would_end_past_the_budget() -> None:
    clock = FakeClock()
    starts, attempt = failing(clock, takes=2.0)
    policy = RetryPolicy(attempts=100, initial_wait_s=1.0, max_wait_s=1.0, budget_s=10.0)
    with pytest.raises(StorageTimeoutError, match=r"gave up after .* \(store timeout 10 s"):
        policy.call("list s3://b/p", attempt, try_worst_s=3.0, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    # every try started early enough to end (worst case 3 s) within 10 s of the start
    assert starts and all(s + 3.0 <= 1000.0 + 10.0 for s in starts)
    assert clock.now <= 1000.0 + 10.0
    assert len(starts) >= 2


def test_waits_never_pass_the_callers_deadline() -> None:
    clock = FakeClock()
    starts, attempt = failing(clock, takes=0.5)
    policy = RetryPolicy(attempts=100, initial_wait_s=20.0, max_wait_s=20.0, budget_s=3600.0)
    with (
        store_deadline(clock.now + 5.0),
        pytest.raises(StorageTimeoutError, match="deadline"),
    ):
        policy.call("upload s3://b/p/k", attempt, try_worst_s=1.0, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert clock.now <= 1000.0 + 5.0
    assert all(s + 1.0 <= 1000.0 + 5.0 for s in starts)


def test_the_first_try_runs_even_with_no_time_left() -> None:
    clock = FakeClock()
    calls: list[float] = []
    policy = RetryPolicy(budget_s=1.0)
    with store_deadline(clock.now - 1.0):
        result = policy.call("head", lambda: calls.append(clock.now) or "ok", clock=clock)
    assert result == "ok" and calls == [1000.0]


def test_progress_restarts_the_budget() -> None:
    """A transfer that keeps moving bytes gets a fresh budget after each stall."""
    clock = FakeClock()
    moved: list[float | None] = [None]
    starts: list[float] = []

    def attempt() -> str:
        starts.append(clock.now)
        clock.now += 8.0
        moved[0] = clock.now - 1.0  # bytes moved until just before the failure
        if len(starts) < 4:
            raise StorageTransientError("connection reset")
        return "done"

    policy = RetryPolicy(attempts=10, initial_wait_s=0.1, max_wait_s=0.1, budget_s=10.0)
    result = policy.call(
        "download s3://b/p/k",
        attempt,
        try_worst_s=1.0,
        last_progress=lambda: moved[0],
        clock=clock,
        sleep=clock.sleep,
    )
    assert result == "done" and len(starts) == 4  # 32 s in all, budget 10 s


# -- a slow link: the read timeout is per socket read ---------------------------------------


class ThrottledRelay:
    """A TCP relay to the real server that moves at most `rate` bytes/s in each direction of
    each connection, in 64 KiB slices (no shared budget: no connection starves another)."""

    def __init__(self, upstream: str, *, rate: float) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._rate = rate
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="relay").start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = src.recv(64 * 1024)
                if not data:
                    break
                time.sleep(len(data) / self._rate)
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_transfer_longer_than_its_read_timeout_completes_on_a_slow_link(
    s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Store timeout 30 s (connect and read timeouts 5 s): a 20 MiB object, at 2 MiB/s per
    connection, takes about 8 s each way (its 16 MiB part or range is the longest), up in
    multipart parts and down in ranged GETs, and arrives whole. (The link must drain a
    socket's send buffer, a few MiB, within the read timeout: the answer to a part comes only
    after that.)"""
    settings = TransferSettings.for_store_timeout(30.0)
    assert settings.read_timeout_s == 5.0 and settings.connect_timeout_s == 5.0
    bucket = s3_env.create_bucket()
    relay = ThrottledRelay(s3_env.endpoint, rate=2 * MiB)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", relay.endpoint)
        store = S3Storage.from_uri(f"s3://{bucket}/run", store_timeout_s=30.0)
        data = hashlib.sha256(b"slow").digest() * (20 * MiB // 32)
        src = tmp_path / "big.bin"
        src.write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        started = time.monotonic()
        store.put_file("big.bin", src, sha256=digest)
        up = time.monotonic() - started
        started = time.monotonic()
        store.get_file("big.bin", tmp_path / "back.bin", sha256=digest, size=len(data))
        down = time.monotonic() - started
    finally:
        relay.close()
    assert (tmp_path / "back.bin").read_bytes() == data
    # each way took longer than the read timeout (else this shows nothing)
    assert up > 5.0 and down > 5.0, (up, down)
