"""The spot-VM and local-stack deployment files agree with each other and with the runner.

What runs for real here: `systemd-analyze verify` on the unit and `promtool check config` on
the compose stack's Prometheus configuration. The compose stack itself is not started (no
registry is reachable for its SeaweedFS and Prometheus images); its wiring is checked."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fixtures.cli_options import cli_env_vars
from tests.fixtures.docker import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "spot-runner.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "runner.env.example"
CLOUD_INIT = DEPLOY / "cloud-init" / "spot-vm.yaml"
COMPOSE = DEPLOY / "docker-compose.yml"
# GCP spot and Azure spot give 30 s from the shutdown signal to power-off.
SHORTEST_NOTICE_WINDOW_S = 30


def unit_directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every directive, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    section = ""
    result = []
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, value = line.split("=", 1)
        result.append((section, key.strip(), " ".join(value.split())))
    return result


def directive(directives: list[tuple[str, str, str]], key: str) -> list[str]:
    return [v for _, k, v in directives if k == key]


def env_file(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if line and line[0] != "#")
    return {k.strip(): v.strip() for k, v in pairs}


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, f"unexpected duration {value!r}"
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def int_flag(command: str, flag: str) -> int:
    match = re.search(rf"{flag} (\d+)", command)
    assert match, f"{flag} missing from {command!r}"
    return int(match.group(1))


def test_systemd_unit_verifies() -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze not found: apt-get install -y systemd")
    proc = subprocess.run(
        [analyze, "verify", str(UNIT)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "spot-runner.service" not in proc.stderr, proc.stderr


def test_systemd_stop_timeouts_nest_inside_the_notice_window() -> None:
    directives = unit_directives(UNIT.read_text())
    (exec_start,) = directive(directives, "ExecStart")
    (exec_stop,) = directive(directives, "ExecStop")
    (timeout_stop,) = directive(directives, "TimeoutStopSec")
    docker_stop = int_flag(exec_stop, "--time")
    stop_timeout = int_flag(exec_start, "--stop-timeout")
    grace = float(env_file(ENV_EXAMPLE.read_text())["RUNNER_GRACE_SECONDS"])
    assert grace < docker_stop == stop_timeout < seconds(timeout_stop) <= SHORTEST_NOTICE_WINDOW_S
    assert "--env-file /etc/spot-runner/runner.env" in exec_start
    assert exec_start.split()[-2:] == ["runner", "demo"]
    # Configuration (2) and integrity (3) failures are not retried; a preemption (75) is.
    assert directive(directives, "RestartPreventExitStatus") == ["2 3"]
    assert directive(directives, "Restart") == ["on-failure"]


def test_env_example_sets_only_options_the_runner_reads() -> None:
    keys = set(env_file(ENV_EXAMPLE.read_text()))
    runner_keys = {k for k in keys if k.startswith("RUNNER_")}
    assert runner_keys <= cli_env_vars()
    assert {"RUNNER_MIRROR", "RUNNER_GRACE_SECONDS", "AWS_ACCESS_KEY_ID"} <= keys


def cloud_init() -> dict[str, Any]:
    text = CLOUD_INIT.read_text()
    assert text.startswith("#cloud-config\n")
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def test_cloud_init_installs_the_same_unit_and_settings() -> None:
    files = {f["path"]: f for f in cloud_init()["write_files"]}
    unit = files["/etc/systemd/system/spot-runner.service"]["content"]
    assert unit_directives(unit) == unit_directives(UNIT.read_text())
    env = files["/etc/spot-runner/runner.env"]
    assert env["permissions"] == "0600"  # it holds the bucket credentials
    assert env_file(env["content"]) == env_file(ENV_EXAMPLE.read_text())
    commands = [" ".join(c) if isinstance(c, list) else c for c in cloud_init()["runcmd"]]
    assert commands[-1] == "systemctl enable --now spot-runner.service"
    assert "docker.io" in cloud_init()["packages"]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_stack_wiring() -> None:
    services = compose()["services"]
    assert set(services) == {"s3", "create-bucket", "runner", "prometheus"}
    runner = services["runner"]
    env = {k: str(v) for k, v in runner["environment"].items()}
    assert {k for k in env if k.startswith("RUNNER_")} <= cli_env_vars()
    assert env["RUNNER_MIRROR"].startswith("s3://spot-runner/")
    assert env["AWS_ENDPOINT_URL_S3"] == "http://s3:8333"
    assert "-s3.port=8333" in services["s3"]["command"]
    assert seconds(runner["stop_grace_period"]) > float(env["RUNNER_GRACE_SECONDS"])
    assert runner["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert f"{env['RUNNER_METRICS_PORT']}:{env['RUNNER_METRICS_PORT']}" in runner["ports"]
    # The alert rules H5 generates are mounted from deploy/prometheus/.
    mounts = services["prometheus"]["volumes"]
    (rules_mount,) = [m for m in mounts if m.startswith("./prometheus/")]
    assert (DEPLOY / rules_mount.split(":")[0]).is_file()


def test_compose_prometheus_config_is_valid_and_scrapes_the_runner(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: apt-get install -y prometheus")
    stack = compose()
    config = yaml.safe_load(stack["configs"]["prometheus-config"]["content"])
    (rules_path,) = config["rule_files"]
    (mount,) = [m for m in stack["services"]["prometheus"]["volumes"] if rules_path in m]
    # Point the rule file at its real location so promtool checks the rules too.
    config["rule_files"] = [str(DEPLOY / mount.split(":")[0])]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    (job,) = config["scrape_configs"]
    port = stack["services"]["runner"]["environment"]["RUNNER_METRICS_PORT"]
    assert job["static_configs"][0]["targets"] == [f"runner:{port}"]
    alerts = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    (down,) = [r for g in alerts["groups"] for r in g["rules"] if r.get("alert") == "RunnerDown"]
    selector = re.search(r'job=~"([^"]+)"', down["expr"])
    assert selector is not None and re.fullmatch(selector.group(1), job["job_name"])
