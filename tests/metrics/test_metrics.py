"""RunnerMetrics in its own registry, with an injected clock, and its HTTP server."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from runner.errors import ConfigError
from runner.metrics.registry import (
    DURATION_BUCKETS,
    FAILURE_STAGES,
    NOTICE_SOURCES,
    RunnerMetrics,
)
from runner.metrics.server import maybe_serve_metrics, serve_metrics

# Every metric name DESIGN.md promises (the dashboard and alert rules rely on them).
CONTRACT_NAMES = {
    "runner_checkpoint_last_success_timestamp_seconds",
    "runner_checkpoint_age_seconds",
    "runner_checkpoint_last_step",
    "runner_train_step",
    "runner_checkpoint_save_duration_seconds",
    "runner_checkpoint_upload_duration_seconds",
    "runner_checkpoint_bytes",
    "runner_checkpoint_failures_total",
    "runner_preemption_notices_total",
    "runner_resumes_total",
    "runner_steps_lost_total",
}


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000.0)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry, clock: FakeClock) -> RunnerMetrics:
    return RunnerMetrics(registry, clock=clock)


def age(registry: CollectorRegistry, location: str) -> float | None:
    return registry.get_sample_value("runner_checkpoint_age_seconds", {"location": location})


def test_age_counts_from_process_start_before_any_checkpoint(registry, metrics, clock):
    assert age(registry, "local") == 0.0
    clock.now += 42.5
    assert age(registry, "local") == 42.5
    assert age(registry, "remote") == 42.5
    # No checkpoint yet: no timestamp or step series to mistake for a real one.
    assert (
        registry.get_sample_value(
            "runner_checkpoint_last_success_timestamp_seconds", {"location": "local"}
        )
        is None
    )


def test_age_is_computed_at_scrape_time_and_resets_on_each_checkpoint(registry, metrics, clock):
    clock.now += 100
    metrics.checkpoint_saved(step=10, duration_s=0.3, size_bytes=4096)
    assert age(registry, "local") == 0.0
    assert age(registry, "remote") == 100.0
    clock.now += 7
    metrics.checkpoint_uploaded(step=10, duration_s=2.0)
    clock.now += 30
    assert age(registry, "local") == 37.0
    assert age(registry, "remote") == 30.0
    metrics.checkpoint_saved(step=20, duration_s=0.4, size_bytes=8192)
    assert age(registry, "local") == 0.0
    assert age(registry, "remote") == 30.0


def test_checkpoint_gauges_and_histograms(registry, metrics, clock):
    metrics.checkpoint_saved(step=10, duration_s=0.3, size_bytes=4096)
    clock.now += 5
    metrics.checkpoint_uploaded(step=10, duration_s=2.0)
    metrics.checkpoint_saved(step=20, duration_s=0.05, size_bytes=8192)
    get = registry.get_sample_value
    assert get("runner_checkpoint_last_step", {"location": "local"}) == 20
    assert get("runner_checkpoint_last_step", {"location": "remote"}) == 10
    assert (
        get("runner_checkpoint_last_success_timestamp_seconds", {"location": "local"})
        == 1_000_005.0
    )
    assert (
        get("runner_checkpoint_last_success_timestamp_seconds", {"location": "remote"})
        == 1_000_005.0
    )
    assert get("runner_checkpoint_bytes") == 8192
    assert get("runner_checkpoint_save_duration_seconds_count") == 2
    assert get("runner_checkpoint_save_duration_seconds_sum") == pytest.approx(0.35)
    assert get("runner_checkpoint_save_duration_seconds_bucket", {"le": "0.1"}) == 1
    assert get("runner_checkpoint_save_duration_seconds_bucket", {"le": "0.5"}) == 2
    assert get("runner_checkpoint_upload_duration_seconds_count") == 1
    assert get("runner_checkpoint_upload_duration_seconds_bucket", {"le": "1.0"}) == 0
    assert get("runner_checkpoint_upload_duration_seconds_bucket", {"le": "2.5"}) == 1


def test_duration_buckets_cover_a_tenth_of_a_second_to_ten_minutes():
    assert DURATION_BUCKETS[0] == 0.1
    assert DURATION_BUCKETS[-1] == 600.0
    assert list(DURATION_BUCKETS) == sorted(DURATION_BUCKETS)


def test_counters_start_at_zero_for_every_known_label(registry, metrics):
    # increase() only sees a first failure if the series already existed at 0.
    for stage in FAILURE_STAGES:
        value = registry.get_sample_value("runner_checkpoint_failures_total", {"stage": stage})
        assert value == 0.0
    for source in NOTICE_SOURCES:
        value = registry.get_sample_value("runner_preemption_notices_total", {"source": source})
        assert value == 0.0


def test_failures_notices_resumes_and_steps(registry, metrics):
    get = registry.get_sample_value
    metrics.checkpoint_failed("upload")
    metrics.checkpoint_failed("upload")
    metrics.checkpoint_failed("save")
    metrics.preemption_notice("sigterm")
    metrics.preemption_notice("aws")
    metrics.resumed(steps_lost=37)
    metrics.resumed()
    metrics.train_step(123)
    assert get("runner_checkpoint_failures_total", {"stage": "upload"}) == 2
    assert get("runner_checkpoint_failures_total", {"stage": "save"}) == 1
    assert get("runner_checkpoint_failures_total", {"stage": "verify"}) == 0
    assert get("runner_preemption_notices_total", {"source": "sigterm"}) == 1
    assert get("runner_preemption_notices_total", {"source": "aws"}) == 1
    assert get("runner_preemption_notices_total", {"source": "gcp"}) == 0
    assert get("runner_resumes_total") == 2
    assert get("runner_steps_lost_total") == 37
    assert get("runner_train_step") == 123


def test_negative_steps_lost_is_refused(metrics):
    with pytest.raises(ValueError, match="steps_lost must be >= 0"):
        metrics.resumed(steps_lost=-1)


def test_checkpoint_found_on_resume_ages_from_its_creation(registry, metrics, clock):
    # A run preempted before it could checkpoint again must not look fresh after a restart.
    metrics.checkpoint_found(location="remote", step=300, created_at=clock.now - 1800)
    assert age(registry, "remote") == 1800.0
    assert registry.get_sample_value("runner_checkpoint_last_step", {"location": "remote"}) == 300
    # Never backwards: an older checkpoint found later changes nothing.
    metrics.checkpoint_found(location="remote", step=200, created_at=clock.now - 3600)
    assert age(registry, "remote") == 1800.0
    assert registry.get_sample_value("runner_checkpoint_last_step", {"location": "remote"}) == 300


def test_checkpoint_found_refuses_an_unknown_location(metrics):
    with pytest.raises(ValueError, match="location must be 'local' or 'remote'"):
        metrics.checkpoint_found(location="bucket", step=1, created_at=0.0)


def test_unmirrored_run_has_no_remote_age(registry, clock):
    metrics = RunnerMetrics(registry, clock=clock, mirrored=False)
    clock.now += 5
    assert age(registry, "local") == 5.0
    assert age(registry, "remote") is None
    assert metrics.health()["checkpoint_age_seconds"] == {"local": 5.0}


def test_clock_going_backwards_never_gives_a_negative_age(registry, metrics, clock):
    metrics.checkpoint_saved(step=1, duration_s=0.1, size_bytes=1)
    clock.now -= 10
    assert age(registry, "local") == 0.0


def test_default_registry_is_private(clock):
    first = RunnerMetrics(clock=clock)
    second = RunnerMetrics(clock=clock)  # same names again: would clash in one registry
    first.train_step(5)
    assert first.registry is not second.registry
    assert second.registry.get_sample_value("runner_train_step") == 0
    assert REGISTRY.get_sample_value("runner_train_step") is None


def fetch(url: str, *, accept: str | None = None) -> tuple[int, str, str]:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def test_server_exposes_every_contract_metric_and_health(metrics, clock):
    metrics.train_step(40)
    metrics.checkpoint_saved(step=40, duration_s=0.2, size_bytes=100)
    clock.now += 12
    with serve_metrics(metrics, host="127.0.0.1", port=None) as server:
        assert server.port > 0
        status, content_type, text = fetch(f"{server.url}/metrics")
        assert status == 200
        assert content_type.startswith("text/plain; version=0.0.4")
        families = {f.name for f in text_string_to_metric_families(text)}
        # Counters' families drop the _total suffix in the parser.
        assert CONTRACT_NAMES - families - {f"{n}_total" for n in families} == set()
        assert 'runner_checkpoint_age_seconds{location="local"} 12.0' in text

        status, content_type, body = fetch(f"{server.url}/healthz")
        assert (status, content_type) == (200, "application/json")
        assert json.loads(body) == {
            "status": "ok",
            "step": 40,
            "checkpoint_age_seconds": {"local": 12.0, "remote": 12.0},
            "checkpoint_step": {"local": 40, "remote": None},
        }

        _, content_type, text = fetch(
            f"{server.url}/metrics", accept="application/openmetrics-text; version=1.0.0"
        )
        assert content_type.startswith("application/openmetrics-text")
        assert text.endswith("# EOF\n")

        with pytest.raises(urllib.error.HTTPError) as err:
            fetch(f"{server.url}/nope")
        assert err.value.code == 404

        head = urllib.request.Request(f"{server.url}/healthz", method="HEAD")
        with urllib.request.urlopen(head, timeout=5) as response:
            assert response.status == 200
            assert int(response.headers["Content-Length"]) > 0
            assert response.read() == b""


def test_server_close_releases_the_port(metrics):
    server = serve_metrics(metrics, host="127.0.0.1", port=None)
    port = server.port
    server.close()
    server.close()  # idempotent
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    with pytest.raises(urllib.error.URLError):
        fetch(f"http://127.0.0.1:{port}/metrics")


def test_port_zero_means_disabled_not_random(metrics):
    assert maybe_serve_metrics(metrics, host="127.0.0.1", port=0) is None
    with pytest.raises(ConfigError, match="0 means 'metrics disabled'"):
        serve_metrics(metrics, host="127.0.0.1", port=0)


def test_port_in_use_is_a_config_error_that_says_what_to_do(metrics):
    with serve_metrics(metrics, host="127.0.0.1", port=None) as busy:
        with pytest.raises(ConfigError, match="choose another --metrics-port"):
            serve_metrics(metrics, host="127.0.0.1", port=busy.port)
        # The configured-port path binds the fixed port it was given.
        other = RunnerMetrics(CollectorRegistry())
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            free = sock.getsockname()[1]
        server = maybe_serve_metrics(other, host="127.0.0.1", port=free)
        assert server is not None
        try:
            assert server.port == free
            assert fetch(f"{server.url}/healthz")[0] == 200
        finally:
            server.close()
