"""The image under a real Docker engine, against a real S3 server (SeaweedFS on loopback,
reached with `--network host`). `runner_image` is the image built on the PEP 668 base (torch
in the system interpreter, plain `pip install` refused), the harder of the two test bases.

The preempted container is started from the Kubernetes single-gpu Job translated into
`docker run` (args, ConfigMap env, security context, mounts) and stopped with
`docker stop -t <terminationGracePeriodSeconds>`, so the manifests and the image cannot drift
apart. The other containers use `docker run IMAGE runner demo --flags` directly."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.docker import (
    Docker,
    docker_spec_from_job,
    render_overlay,
    writable_run_dir,
)
from tests.fixtures.s3 import SeaweedS3, free_ports

pytestmark = pytest.mark.e2e

# Far more steps than needed before the stop: a fast machine must not finish the run
# between two polls of the test.
STEPS = 200
CKPT_EVERY = 10
EXIT_PREEMPTED = 75
EXIT_SIGKILL = 137


def env_args(env: dict[str, str]) -> list[str]:
    return [arg for key, value in sorted(env.items()) for arg in ("-e", f"{key}={value}")]


def loss_steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "loss.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if "step" in line and "loss" in line]


def pause_at_step(
    docker: Docker,
    container: str,
    run_dir: Path,
    step: int,
    *,
    also: Callable[[], bool] = lambda: True,
) -> None:
    """Freeze the container once loss.jsonl (on the bind mount) reaches `step` and `also()`
    holds.

    The demo can run hundreds of steps a second on an idle machine; freezing it makes the
    following `docker stop` land mid-run however fast the machine is (`docker stop` delivers
    its signal to a paused container and resumes it). Fails if the container exits first."""
    deadline = time.monotonic() + 300
    polls = 0
    while time.monotonic() < deadline:
        if max((line["step"] for line in loss_steps(run_dir)), default=0) >= step and also():
            docker("pause", container)
            return
        polls += 1
        # `docker inspect` costs tens of ms: the cheap file poll runs far more often
        if polls % 25 == 0 and not docker.inspect(container)["State"]["Running"]:
            pytest.fail(f"container exited before step {step}:\n{docker.logs(container)[-3000:]}")
        time.sleep(0.01)
    pytest.fail(f"step {step} not reached in 300 s:\n{docker.logs(container)[-3000:]}")


def local_steps(run_dir: Path) -> list[int]:
    ckpts = run_dir / "checkpoints"
    return sorted(
        int(p.name.removeprefix("step_"))
        for p in ckpts.glob("step_*")
        if (p / "manifest.json").is_file()
    )


def remote_steps(s3: Any, bucket: str, prefix: str) -> list[int]:
    keys = [
        obj["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{prefix}/checkpoints/"
        )
        for obj in page.get("Contents", [])
    ]
    return sorted(
        int(key.split("/")[-2].removeprefix("step_"))
        for key in keys
        if key.endswith("/manifest.json")
    )


def remote_manifest_bytes(s3: Any, bucket: str, prefix: str, step: int) -> bytes:
    key = f"{prefix}/checkpoints/step_{step:06d}/manifest.json"
    body: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def assert_remote_checkpoint_complete(s3: Any, bucket: str, prefix: str, step: int) -> None:
    """Every file the manifest lists is in the bucket with its size (sha256 is the runner's
    own check; sizes and presence are checked here independently)."""
    manifest = json.loads(remote_manifest_bytes(s3, bucket, prefix, step))
    for entry in manifest["files"]:
        key = f"{prefix}/checkpoints/step_{step:06d}/{entry['path']}"
        assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == entry["size"]


def demo_container(
    docker: Docker, image: str, s3: SeaweedS3, *, run_dir: Path, mirror: str, ckpt_every: int
) -> str:
    # host networking shares the port space with the machine: no fixed metrics port
    (metrics_port,) = free_ports(1)
    env = {**s3.env(), "RUNNER_METRICS_PORT": str(metrics_port)}
    return docker.start(
        image,
        run_args=["--network", "host", "-v", f"{run_dir}:/data", *env_args(env)],
        command=[
            "runner",
            "demo",
            "--run-dir",
            "/data/run",
            "--mirror",
            mirror,
            "--steps",
            str(STEPS),
            "--ckpt-every",
            str(ckpt_every),
        ],
    )


def test_docker_stop_checkpoints_to_the_bucket_and_a_fresh_container_resumes(
    docker: Docker, runner_image: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    started = time.monotonic()
    bucket = s3_server.create_bucket()
    s3 = s3_server.client()

    # The uninterrupted run: its final fingerprint is what the preempted run must reach.
    reference = demo_container(
        docker,
        runner_image,
        s3_server,
        run_dir=writable_run_dir(tmp_path / "reference"),
        mirror=f"s3://{bucket}/reference",
        ckpt_every=CKPT_EVERY,
    )
    assert docker.wait(reference, timeout=600) == 0, docker.logs(reference)[-3000:]
    expected = json.loads(remote_manifest_bytes(s3, bucket, "reference", STEPS))["fingerprint"]

    # Node 1: the Kubernetes container spec, preempted by `docker stop`.
    node1 = writable_run_dir(tmp_path / "node1")
    (metrics_port,) = free_ports(1)
    secret = s3_server.env()
    spec = docker_spec_from_job(
        render_overlay("single-gpu"),
        secret_env={k: secret[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
        overrides={
            # What a user sets per cluster: their bucket and endpoint, and a short run.
            "RUNNER_MIRROR": f"s3://{bucket}/preempted",
            "AWS_ENDPOINT_URL_S3": s3_server.endpoint,
            "RUNNER_STEPS": str(STEPS),
            "RUNNER_CKPT_EVERY": str(CKPT_EVERY),
            # host networking shares the port space with the rest of the machine
            "RUNNER_METRICS_PORT": str(metrics_port),
            **{k: v for k, v in secret.items() if k.startswith("AWS_") and "KEY" not in k},
        },
        mounts={"/data": str(node1)},
    )
    assert spec.command == ["runner", "demo"]
    assert spec.stop_grace_s > float(spec.env["RUNNER_GRACE_SECONDS"])
    preempted = docker.start(
        runner_image, run_args=["--network", "host", *spec.run_args], command=spec.command
    )
    run1 = node1 / "run"
    pause_at_step(docker, preempted, run1, CKPT_EVERY + 2)
    assert docker.stop(preempted, grace_s=spec.stop_grace_s) == EXIT_PREEMPTED, docker.logs(
        preempted
    )[-3000:]

    # The final checkpoint is the step reached, committed locally and durable in the bucket.
    reached = max(line["step"] for line in loss_steps(run1))
    assert CKPT_EVERY < reached < STEPS
    assert local_steps(run1)[-1] == reached
    assert remote_steps(s3, bucket, "preempted")[-1] == reached
    # The same checkpoint: fingerprint and payload hashes (the mirror files it under a
    # per-attempt directory, so paths differ).
    remote = json.loads(remote_manifest_bytes(s3, bucket, "preempted", reached))
    local = json.loads((run1 / "checkpoints" / f"step_{reached:06d}" / "manifest.json").read_text())
    assert remote["fingerprint"] == local["fingerprint"]
    assert sorted((f["sha256"], f["size"]) for f in remote["files"]) == sorted(
        (f["sha256"], f["size"]) for f in local["files"]
    )
    assert_remote_checkpoint_complete(s3, bucket, "preempted", reached)
    # Any subcommand runs from the image: the runner's own verification of the bucket.
    verify = docker(
        "run",
        "--rm",
        "--network",
        "host",
        *env_args(s3_server.env()),
        runner_image,
        "runner",
        "verify",
        f"s3://{bucket}/preempted",
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    newest = verify.stdout.splitlines()[0].split()
    assert newest == ["step", str(reached), "ok"], verify.stdout

    # Node 2: a fresh, empty volume; only the bucket carries the state over.
    node2 = writable_run_dir(tmp_path / "node2")
    resumed = demo_container(
        docker,
        runner_image,
        s3_server,
        run_dir=node2,
        mirror=f"s3://{bucket}/preempted",
        ckpt_every=CKPT_EVERY,
    )
    assert docker.wait(resumed, timeout=600) == 0, docker.logs(resumed)[-3000:]
    final = json.loads(remote_manifest_bytes(s3, bucket, "preempted", STEPS))
    assert final["fingerprint"] == expected, (
        docker.logs(preempted)[-2000:] + "\n----\n" + docker.logs(resumed)[-4000:]
    )
    # It resumed from the bucket rather than retraining (a run from scratch would reach the
    # same fingerprint): the runner names the downloaded step, and node 2's loss history up
    # to it is node 1's, carried in the checkpoint.
    assert re.search(
        rf"resuming from step {reached}, downloaded from s3://{bucket}/preempted",
        docker.logs(resumed),
    ), docker.logs(resumed)[-3000:]
    history1 = {line["step"]: line["loss"] for line in loss_steps(run1)}
    history2 = {line["step"]: line["loss"] for line in loss_steps(node2 / "run")}
    assert sorted(history2) == list(range(1, STEPS + 1))
    assert {step: history2[step] for step in range(1, reached + 1)} == history1
    print(f"[docker] container e2e sequence: {time.monotonic() - started:.1f} s")


def test_docker_kill_loses_only_the_steps_since_the_last_periodic_checkpoint(
    docker: Docker, runner_image: str, s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.create_bucket()
    s3 = s3_server.client()
    every = 5
    node = writable_run_dir(tmp_path / "node")
    container = demo_container(
        docker, runner_image, s3_server, run_dir=node, mirror=f"s3://{bucket}/k", ckpt_every=every
    )
    run_dir = node / "run"
    # Freeze only once a periodic checkpoint is in the bucket: the mirror uploads only the
    # newest one, so on a fast machine training could otherwise outrun every upload.
    pause_at_step(
        docker, container, run_dir, 2 * every + 2, also=lambda: bool(remote_steps(s3, bucket, "k"))
    )
    # SIGKILL at once: no final checkpoint. `docker kill`, not `docker stop -t 0`: that sends
    # SIGTERM first, and an async save can commit the stop step before its SIGKILL lands.
    docker("kill", container)
    assert docker.wait(container, timeout=60) == EXIT_SIGKILL

    reached = max(line["step"] for line in loss_steps(run_dir))
    local = local_steps(run_dir)
    assert local and all(step % every == 0 for step in local), local
    # A step's loss line is written before its checkpoint commits, so a kill during the save
    # of step `reached` (a multiple of `every`) loses exactly `every` steps; never more.
    assert 0 <= reached - local[-1] <= every, (reached, local)
    if reached - local[-1] == every:
        assert reached % every == 0, (reached, local)
    remote = remote_steps(s3, bucket, "k")
    assert remote and all(step % every == 0 for step in remote), remote
    # The newest periodic checkpoint may still have been uploading when the kill came; what
    # the bucket holds is complete and never ahead of the disk.
    assert remote[-1] <= local[-1]
    assert_remote_checkpoint_complete(s3, bucket, "k", remote[-1])
