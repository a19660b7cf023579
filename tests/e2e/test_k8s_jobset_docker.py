"""The JobSet overlay's pod spec run for real: its two pods translated into `docker run`
(args, ConfigMap env, security context, mounts: tests/fixtures/docker.py) as two containers
of the image on one bridge network, each with its own run dir, pod 0 reachable under the DNS
name JobSet gives it (`spot-runner-node-0-0.spot-runner-nodes`, a network alias here), the
bucket a real SeaweedFS reached through a relay on the network's gateway (the server listens
on this machine's loopback; the relay is the fault proxy with no faults).

`docker stop -t <terminationGracePeriodSeconds>` on pod 1 (what Kubernetes does to a
preempted pod) stops both: each container exits 75, the code the pod failure policy maps to
a gang restart, and the bucket holds one complete checkpoint of both ranks. One deviation from
the manifest: `--nproc-per-node=1` instead of 4, for this 2-core machine."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_checkpoint
from runner.storage import open_storage
from tests.fixtures.docker import (
    Docker,
    DockerSpec,
    docker_spec_from_job,
    find_resource,
    render_overlay,
    writable_run_dir,
)
from tests.fixtures.fault_proxy import FaultProxy
from tests.fixtures.s3 import SeaweedS3

pytestmark = pytest.mark.e2e

NODES = 2
EXIT_PREEMPTED = 75


@pytest.fixture
def bridge(docker: Docker) -> Iterator[tuple[str, str]]:
    """A user-defined bridge network (containers resolve each other's aliases on it) and its
    gateway address; removed at teardown, after the docker fixture removed its containers."""
    name = f"spot-runner-test-{uuid.uuid4().hex[:10]}"
    docker("network", "create", "--driver", "bridge", name)
    try:
        info = json.loads(docker("network", "inspect", name).stdout)[0]
        yield name, info["IPAM"]["Config"][0]["Gateway"]
    finally:
        docker.cleanup()  # its containers first: a network in use cannot be removed
        docker("network", "rm", name, check=False)


def pod_specs(bucket: str, endpoint: str, s3: SeaweedS3, run_dirs: list[Path]) -> list[DockerSpec]:
    """Each pod of the rendered JobSet as `docker run`: its replicated Job's template, with
    what the JobSet controller and the kubelet fill in (NNODES, NODE_RANK from the pod's
    annotations) and what a user sets per cluster (bucket, endpoint, a short run)."""
    docs = render_overlay("jobset")
    jobset = find_resource(docs, "JobSet")
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == NODES
    job: dict[str, Any] = {"kind": "Job", "metadata": {"name": "node"}, **replicated["template"]}
    secret = s3.env()
    specs = []
    for i, run_dir in enumerate(run_dirs):
        spec = docker_spec_from_job(
            [*docs, job],
            secret_env={k: secret[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
            overrides={
                **{k: v for k, v in secret.items() if k.startswith("AWS_") and "KEY" not in k},
                "NNODES": str(NODES),
                "NODE_RANK": str(i),
                "RUNNER_MIRROR": f"s3://{bucket}/jobset",
                "AWS_ENDPOINT_URL_S3": endpoint,
                "RUNNER_STEPS": "400",
                "RUNNER_CKPT_EVERY": "10",
                "RUNNER_NOTICES": "off",  # no metadata server on this network
            },
            mounts={"/data": str(run_dir)},
        )
        specs.append(spec)
    return specs


def test_the_jobset_pods_stop_together_when_one_is_stopped_and_commit_in_the_bucket(
    docker: Docker,
    runner_image: str,
    s3_env: SeaweedS3,
    bridge: tuple[str, str],
    tmp_path: Path,
) -> None:
    network, gateway = bridge
    s3_server = s3_env  # its variables set here too: this process reads the bucket
    relay = FaultProxy(s3_server.endpoint, listen=gateway)
    try:
        bucket = s3_server.create_bucket()
        run_dirs = [writable_run_dir(tmp_path / f"pod{i}") for i in range(NODES)]
        specs = pod_specs(bucket, relay.endpoint, s3_server, run_dirs)
        names = []
        for i, spec in enumerate(specs):
            assert "--nproc-per-node=4" in spec.command
            command = [
                "--nproc-per-node=1" if arg == "--nproc-per-node=4" else arg for arg in spec.command
            ]
            assert command[:4] == ["runner", "run", "--", "torchrun"]
            assert f"--node-rank={i}" in command and f"--nnodes={NODES}" in command
            hostname = f"spot-runner-node-{i}-0"
            names.append(
                docker.start(
                    runner_image,
                    run_args=[
                        "--network",
                        network,
                        "--hostname",
                        hostname,
                        "--network-alias",
                        f"{hostname}.spot-runner-nodes",
                        *spec.run_args,
                    ],
                    command=command,
                )
            )
        storage = open_storage(f"s3://{bucket}/jobset")
        deadline = time.monotonic() + 240
        while not list_checkpoints(storage):
            for name in names:
                state = docker.inspect(name)["State"]
                assert state["Running"], docker.logs(name)[-4000:]
            assert time.monotonic() < deadline, [docker.logs(n)[-3000:] for n in names]
            time.sleep(0.2)

        # Kubernetes preempts pod 1: SIGTERM, SIGKILL after the grace period
        assert docker.stop(names[1], grace_s=specs[1].stop_grace_s) == EXIT_PREEMPTED, docker.logs(
            names[1]
        )[-4000:]
        assert docker.wait(names[0], timeout=120) == EXIT_PREEMPTED, docker.logs(names[0])[-4000:]
    finally:
        relay.close()

    final = verify_checkpoint(storage, list_checkpoints(storage)[-1])  # every file hashed
    assert (final.world_size, final.format, final.extra["reason"]) == (2, "torch-dcp", "stop")
    logs = [docker.logs(name) for name in names]
    assert f"stopped by SIGTERM at step {final.step}" in logs[1], logs[1][-4000:]
    assert f"stopped by stop requested on another rank at step {final.step}" in logs[0]
    for i, log in enumerate(logs):
        assert "the ranks commit checkpoints in s3://" in log, log[-3000:]
        assert not list((run_dirs[i] / "run" / "checkpoints").glob("step_*"))
