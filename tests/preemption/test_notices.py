"""Preemption notice pollers against a fake cloud (loopback HTTP server imitating the AWS,
GCP and Azure metadata endpoints)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from runner.config import RunConfig
from runner.metrics.registry import RunnerMetrics
from runner.preemption.clouds import AwsSpotNotice
from runner.preemption.notices import NoticePoller, start_notice_poller
from runner.preemption.stop import StopController
from tests.fixtures.metadata_server import FakeCloud

POLL = 0.25


def _config(tmp_path: Path, notices: str, endpoint: str, poll: float = POLL) -> RunConfig:
    return RunConfig(
        run_dir=tmp_path, notices=notices, notice_endpoint=endpoint, notice_poll_seconds=poll
    )


@pytest.fixture
def controller() -> Iterator[StopController]:
    c = StopController()
    yield c
    c.close()


def _wait_for_polls(poller: NoticePoller, n: int, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while poller.polls < n:
        assert time.monotonic() < end, f"poller made {poller.polls} polls, wanted {n}"
        time.sleep(0.01)


def _assert_stop_within_two_polls(cloud: FakeCloud, c: StopController) -> float:
    assert c.wait(5.0), "no stop requested after the notice"
    posted = cloud.state.notice_posted_at
    assert posted is not None
    delay = c.requests[0].at - posted
    assert 0 <= delay <= 2 * POLL, f"stop requested {delay:.3f}s after the notice"
    return c.requests[0].at


def _utc_in(seconds: float) -> datetime:
    return datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=seconds)


@pytest.mark.slow
def test_aws_notice_stops_within_two_polls_with_the_notice_deadline(
    tmp_path: Path, fake_cloud: FakeCloud, controller: StopController
) -> None:
    registry = CollectorRegistry()
    metrics = RunnerMetrics(registry)
    poller = start_notice_poller(_config(tmp_path, "aws", fake_cloud.url), controller, metrics)
    assert poller is not None
    try:
        _wait_for_polls(poller, 3)
        assert not controller.stop_requested
        when = _utc_in(120)
        fake_cloud.aws_notice(time_iso=when.strftime("%Y-%m-%dT%H:%M:%SZ"))
        at = _assert_stop_within_two_polls(fake_cloud, controller)
    finally:
        poller.close()
    expected = at + (when.timestamp() - time.time())
    assert controller.deadline == pytest.approx(expected, abs=0.5)
    assert controller.reason == "aws preemption notice"
    assert registry.get_sample_value("runner_preemption_notices_total", {"source": "aws"}) == 1.0
    # IMDSv2: a token was requested with a TTL, and every read carried an issued token
    puts = fake_cloud.requests_to("/latest/api/token")
    assert puts and all(r[0] == "PUT" for r in puts)
    assert all(r[2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600" for r in puts)
    gets = fake_cloud.requests_to("/latest/meta-data/spot/instance-action")
    assert all(r[2]["x-aws-ec2-metadata-token"] in fake_cloud.state.tokens for r in gets)
    assert not poller.running  # one notice is enough


def test_aws_expired_token_is_renewed(fake_cloud: FakeCloud) -> None:
    source = AwsSpotNotice(fake_cloud.url, timeout=1.0)
    assert source.check() is None
    fake_cloud.revoke_tokens()
    fake_cloud.aws_notice(time_iso="2030-01-01T00:00:00Z")
    notice = source.check()
    assert notice is not None
    assert notice.deadline_unix == datetime(2030, 1, 1, tzinfo=UTC).timestamp()
    assert len(fake_cloud.requests_to("/latest/api/token")) == 2


@pytest.mark.slow
def test_gcp_notice_stops_within_two_polls_with_30s_deadline(
    tmp_path: Path, fake_cloud: FakeCloud, controller: StopController
) -> None:
    poller = start_notice_poller(_config(tmp_path, "gcp", fake_cloud.url), controller)
    assert poller is not None
    try:
        _wait_for_polls(poller, 3)
        assert not controller.stop_requested
        fake_cloud.gcp_preempt()
        at = _assert_stop_within_two_polls(fake_cloud, controller)
    finally:
        poller.close()
    assert controller.deadline == pytest.approx(at + 30.0, abs=0.2)
    reads = fake_cloud.requests_to("/computeMetadata/v1/instance/preempted")
    assert reads and all(r[2]["metadata-flavor"] == "Google" for r in reads)


@pytest.mark.slow
def test_azure_preempt_event_stops_with_not_before_deadline(
    tmp_path: Path, fake_cloud: FakeCloud, controller: StopController
) -> None:
    poller = start_notice_poller(_config(tmp_path, "azure", fake_cloud.url), controller)
    assert poller is not None
    try:
        fake_cloud.azure_event(event_type="Reboot", not_before=format_datetime(_utc_in(600), True))
        _wait_for_polls(poller, poller.polls + 3)
        assert not controller.stop_requested  # only Preempt counts
        when = _utc_in(45)
        fake_cloud.azure_event(
            event_type="Preempt", not_before=format_datetime(when, usegmt=True), event_id="E2"
        )
        at = _assert_stop_within_two_polls(fake_cloud, controller)
    finally:
        poller.close()
    assert controller.deadline == pytest.approx(at + (when.timestamp() - time.time()), abs=0.5)
    reads = fake_cloud.requests_to("/metadata/scheduledevents?api-version=2020-07-01")
    assert reads and all(r[2]["metadata"] == "true" for r in reads)


def test_azure_preempt_without_not_before_gets_the_minimum_window(
    tmp_path: Path, fake_cloud: FakeCloud, controller: StopController
) -> None:
    fake_cloud.azure_event(event_type="Preempt", not_before="")
    poller = start_notice_poller(_config(tmp_path, "azure", fake_cloud.url), controller)
    assert poller is not None
    try:
        assert controller.wait(5.0)
    finally:
        poller.close()
    assert controller.deadline == pytest.approx(controller.requests[0].at + 30.0, abs=0.2)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_auto_detects_the_cloud_that_answers(
    tmp_path: Path, controller: StopController, cloud: str
) -> None:
    only = FakeCloud(clouds=(cloud,)).start()
    try:
        poller = start_notice_poller(_config(tmp_path, "auto", only.url), controller)
        assert poller is not None
        try:
            _wait_for_polls(poller, 1)
            assert poller.active is not None and poller.active.name == cloud
        finally:
            poller.close()
    finally:
        only.close()


@pytest.mark.slow
def test_auto_off_cloud_does_not_block_start_up(tmp_path: Path, controller: StopController) -> None:
    # A metadata address that accepts connections and never answers: the worst case off-cloud.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        start = time.monotonic()
        poller = start_notice_poller(_config(tmp_path, "auto", url), controller)
        started_in = time.monotonic() - start
        assert poller is not None
        assert started_in < 0.5, f"start-up waited {started_in:.3f}s for the probe (timeout 1 s)"
        assert poller.running  # still probing in the background
        poller.close(timeout=5.0)
    finally:
        silent.close()
    assert poller.active is None
    assert not controller.stop_requested


def test_auto_with_nothing_listening_turns_itself_off(
    tmp_path: Path, controller: StopController
) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    poller = start_notice_poller(_config(tmp_path, "auto", url), controller)
    assert poller is not None
    end = time.monotonic() + 5
    while poller.running:
        assert time.monotonic() < end
        time.sleep(0.02)
    assert poller.active is None and poller.polls == 0


@pytest.mark.slow
def test_unreachable_endpoint_keeps_polling_without_stopping(
    tmp_path: Path, fake_cloud: FakeCloud, controller: StopController
) -> None:
    # The fake cloud imitates GCP only, so the AWS token request fails on every poll.
    gcp_only = FakeCloud(clouds=("gcp",)).start()
    try:
        poller = start_notice_poller(_config(tmp_path, "aws", gcp_only.url), controller)
        assert poller is not None
        try:
            _wait_for_polls(poller, 3)
            assert poller.running and not controller.stop_requested
        finally:
            poller.close()
    finally:
        gcp_only.close()


def test_notices_off_starts_nothing(tmp_path: Path, controller: StopController) -> None:
    assert start_notice_poller(RunConfig(run_dir=tmp_path), controller) is None
