"""The container's HEALTHCHECK probes where the runner really serves: --metrics-host set to
one address (IPv6 included) is probed there, a wildcard bind on loopback."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from runner.metrics.registry import RunnerMetrics
from runner.metrics.server import serve_metrics

SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("host", "url"),
    [
        (None, "http://127.0.0.1:9400/healthz"),
        ("0.0.0.0", "http://127.0.0.1:9400/healthz"),
        ("::", "http://[::1]:9400/healthz"),
        ("[::1]", "http://[::1]:9400/healthz"),
        ("10.1.2.3", "http://10.1.2.3:9400/healthz"),
    ],
)
def test_probe_url_follows_metrics_host(host: str | None, url: str) -> None:
    env = {"RUNNER_METRICS_PORT": "9400"} | ({} if host is None else {"RUNNER_METRICS_HOST": host})
    assert _module().probe_url(env) == url
    assert _module().probe_url({"RUNNER_METRICS_PORT": "0"}) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_healthcheck_probes_a_server_bound_to_one_address(host: str) -> None:
    with serve_metrics(RunnerMetrics(), host=host, port=None) as server:
        env = {**os.environ, "RUNNER_METRICS_PORT": str(server.port), "RUNNER_METRICS_HOST": host}
        probe = subprocess.run(
            [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30
        )
    assert probe.returncode == 0, probe.stderr
