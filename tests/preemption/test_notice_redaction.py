"""A user:password in --notice-endpoint is never logged: metadata requests never send one
(urllib would take it for part of the host name), so it is dropped before polling and any
poll failure message is redacted. Real `runner demo` processes; the metadata server is the
loopback fake cloud (no real one answers off-cloud)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from runner.config import RunConfig
from runner.preemption.notices import start_notice_poller
from runner.preemption.stop import StopController
from tests.fixtures.demo_process import run_demo
from tests.fixtures.metadata_server import FakeCloud

CANARY = "canary-Secret-7f3a91"
# '@', a space, a quote and ':' before the canary: a redaction stopping early would show it
PASSWORD = f'p@ss w"d:{CANARY}'


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_demo_with_a_password_in_an_unreachable_notice_endpoint_never_logs_it(
    tmp_path: Path,
) -> None:
    port = closed_port()
    endpoint = f"http://admin:{PASSWORD}@127.0.0.1:{port}"
    result = run_demo(
        tmp_path / "run",
        "--notices", "aws", "--notice-endpoint", endpoint, "--notice-poll-seconds", "0.1",
        steps=200,
    )  # fmt: skip
    output = result.stdout + (result.stderr or "")
    assert result.returncode == 0, output
    assert CANARY not in output and "admin" not in output, output
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            assert CANARY.encode() not in path.read_bytes(), path
    # the failed poll was logged (the path that used to print the URL), against the bare host
    assert f"aws notice poll failed (1 so far): http://127.0.0.1:{port}/latest/api/token" in (
        output
    ), output
    assert f"--notice-endpoint http://***@127.0.0.1:{port} carries a user:password" in output


def test_notice_endpoint_with_a_password_still_reaches_the_metadata_server(
    tmp_path: Path, fake_cloud: FakeCloud
) -> None:
    """Before, the userinfo went into the host name and no poll ever connected."""
    endpoint = fake_cloud.url.replace("http://", f"http://admin:{PASSWORD}@")
    config = RunConfig(
        run_dir=tmp_path, notices="aws", notice_endpoint=endpoint, notice_poll_seconds=0.1
    )
    controller = StopController()
    poller = start_notice_poller(config, controller)
    assert poller is not None
    try:
        fake_cloud.aws_notice(time_iso="2099-01-01T00:00:00Z")
        assert controller.wait(5.0), "the notice was never seen"
    finally:
        poller.close()
        controller.close()
    assert controller.reason == "aws preemption notice"
    assert fake_cloud.requests_to("/latest/api/token")
