"""A real Prometheus scrapes a running process that exports RunnerMetrics, with the shipped
rules rendered at short thresholds: the stale alert fires when checkpoints stop, and
RunnerDown fires when the process dies."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runner.metrics.alerting import Thresholds, render_rules_file

ROOT = Path(__file__).resolve().parents[2]

# Steps every 0.25 s and checkpoints (saved + mirrored) every other step until the stop file
# appears; then it keeps training without checkpointing, like a run whose saves hang.
DRIVER = """
import sys, time, pathlib
from runner.metrics.registry import RunnerMetrics
from runner.metrics.server import serve_metrics

stop_file = pathlib.Path(sys.argv[1])
metrics = RunnerMetrics()
server = serve_metrics(metrics, host="127.0.0.1", port=None)
print(server.port, flush=True)
step = 0
while True:
    step += 1
    metrics.train_step(step)
    if step % 2 == 0 and not stop_file.exists():
        metrics.checkpoint_saved(step=step, duration_s=0.01, size_bytes=1000)
        metrics.checkpoint_uploaded(step=step, duration_s=0.02)
    time.sleep(0.25)
"""

SHORT = Thresholds(
    stale_after=4,
    stale_for=2,
    mirror_lag=600,
    mirror_lag_for=600,
    failures_window=60,
    down_for=2,
    job_matcher='job="spot-runner"',
)


def wait_for(what: str, check: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def alerts_named(server: Any, name: str) -> list[dict[str, Any]]:
    return [a for a in server.alerts() if a["labels"]["alertname"] == name]


@pytest.mark.slow
@pytest.mark.e2e
def test_stale_alert_fires_when_checkpoints_stop_and_down_when_the_runner_dies(
    start_prometheus, tmp_path
):
    stop_file = tmp_path / "stop-checkpointing"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(stop_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert driver.stdout is not None
        port = int(driver.stdout.readline())
        target = f"127.0.0.1:{port}"
        server = start_prometheus(
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            "rule_files: [alerts.yml]\n"
            "scrape_configs:\n"
            "  - job_name: spot-runner\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n",
            files={"alerts.yml": render_rules_file(SHORT)},
        )
        wait_for(
            "the first scrape", lambda: server.query('runner_train_step{job="spot-runner"}'), 30
        )

        # Checkpointing: well past threshold + for, and nothing is even pending.
        time.sleep(SHORT.stale_after + SHORT.stale_for + 2)
        assert alerts_named(server, "RunnerCheckpointStale") == []
        (age,) = server.query('runner_checkpoint_age_seconds{location="remote"}')
        assert float(age["value"][1]) < SHORT.stale_after

        stop_file.touch()
        stopped = time.monotonic()
        firing = wait_for(
            "RunnerCheckpointStale to fire",
            lambda: [
                a for a in alerts_named(server, "RunnerCheckpointStale") if a["state"] == "firing"
            ],
            30,
        )
        # the last checkpoint may predate the stop by one 0.25 s driver cycle
        assert time.monotonic() - stopped >= SHORT.stale_after + SHORT.stale_for - 0.5
        (alert,) = firing
        assert alert["labels"] == {
            "alertname": "RunnerCheckpointStale",
            "instance": target,
            "job": "spot-runner",
            "location": "remote",
            "severity": "critical",
        }
        assert alert["annotations"]["summary"].startswith(
            f"spot-runner {target}: no remote checkpoint for "
        )
        # Training went on: the step kept advancing while the checkpoints aged.
        (step,) = server.query('runner_train_step{job="spot-runner"}')
        (last,) = server.query('runner_checkpoint_last_step{location="remote"}')
        assert float(step["value"][1]) > float(last["value"][1])
        assert alerts_named(server, "RunnerDown") == []

        driver.terminate()
        driver.wait(timeout=10)
        wait_for(
            "RunnerDown to fire",
            lambda: [a for a in alerts_named(server, "RunnerDown") if a["state"] == "firing"],
            30,
        )
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
