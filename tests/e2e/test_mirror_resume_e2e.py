"""Resume on a fresh node from the bucket alone: `runner demo` with
`--mirror s3://...` SIGTERMed midway, its run dir deleted, restarted in a new empty dir."""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.loss_log import LossLog
from runner.storage.s3 import S3Storage
from tests.fixtures.demo_process import (
    DEMO_STEPS,
    logged_steps,
    manifest,
    run_demo,
    start_demo,
    wait_for_step,
)
from tests.fixtures.s3 import SeaweedS3

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, float]]:
    run_dir = tmp_path_factory.mktemp("straight")
    done = run_demo(run_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(manifest(run_dir, DEMO_STEPS)["fingerprint"]), LossLog(run_dir).read()


def sigterm_midway(s3: SeaweedS3, run_dir: Path, location: str) -> tuple[int, str]:
    """Run with the mirror, SIGTERM at a random step once a periodic checkpoint older than
    that step is in the bucket; returns (the step of the final checkpoint, the output).

    The wait matters: the mirror uploads only the newest checkpoint and does not hold the
    exit for one a newer checkpoint overtook, so without it the final checkpoint could be the
    only one in the bucket."""
    # the client first: making one takes a few hundred ms, in which an idle machine's demo
    # runs to its last step before the SIGTERM
    bucket, prefix = location.removeprefix("s3://").split("/", 1)
    client = s3.client()
    bucket_steps(client, bucket, prefix)
    proc = start_demo(run_dir, "--mirror", location, env=s3.env(), ckpt_every=10)
    wait_for_step(proc, run_dir, random.randint(24, DEMO_STEPS - 20))
    deadline = time.monotonic() + 60
    while True:
        now = max(logged_steps(run_dir))
        if any(step < now for step in bucket_steps(client, bucket, prefix)):
            break
        assert proc.poll() is None and time.monotonic() < deadline, (
            f"no periodic checkpoint reached {location} while the demo ran"
        )
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out
    reached = max(LossLog(run_dir).read())
    assert "durable in local + mirror" in out, out
    return reached, out


def bucket_steps(client: Any, bucket: str, prefix: str) -> list[int]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/checkpoints/")
    return sorted(
        int(obj["Key"].split("/")[-2].removeprefix("step_"))
        for obj in listed.get("Contents", [])
        if obj["Key"].endswith("/manifest.json")
    )


def test_sigterm_delete_run_dir_resume_from_bucket_is_exact(
    s3_server: SeaweedS3, tmp_path: Path, straight: tuple[str, dict[int, float]]
) -> None:
    env = s3_server.env()
    location = f"s3://{s3_server.create_bucket()}/runs/demo"
    first = tmp_path / "node-1"
    reached, _ = sigterm_midway(s3_server, first, location)
    shutil.rmtree(first)  # the node is gone with its disk

    second = tmp_path / "node-2"
    done = run_demo(second, "--mirror", location, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resuming from step {reached}, downloaded from {location}" in done.stderr + (
        done.stdout
    )
    fingerprint, losses = straight
    assert manifest(second, DEMO_STEPS)["fingerprint"] == fingerprint
    assert LossLog(second).read() == losses


def test_corrupt_newest_in_bucket_falls_back_to_the_previous_one(
    s3_server: SeaweedS3,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    straight: tuple[str, dict[int, float]],
) -> None:
    env = s3_server.env()
    bucket = s3_server.create_bucket()
    location = f"s3://{bucket}/runs/demo"
    first = tmp_path / "node-1"
    reached, _ = sigterm_midway(s3_server, first, location)
    shutil.rmtree(first)

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    remote = S3Storage.from_uri(location)
    steps = list_checkpoints(remote)
    assert steps[-1] == reached and steps[0] < reached
    newest = read_manifest(remote, reached)
    key = f"runs/demo/checkpoints/step_{reached:06d}/{newest.files[0].path}"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    second = tmp_path / "node-2"
    done = run_demo(second, "--mirror", location, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    output = done.stdout + done.stderr
    previous = max(s for s in steps if s < reached)
    assert f"not resuming from step {reached}" in output and "sha256" in output
    assert f"resuming from step {previous}, downloaded from {location}" in output
    fingerprint, losses = straight
    assert manifest(second, DEMO_STEPS)["fingerprint"] == fingerprint
    assert LossLog(second).read() == losses
