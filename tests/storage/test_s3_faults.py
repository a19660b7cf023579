"""Fault injection (fake faults, real server): a fault proxy in front of SeaweedFS drops
connections mid-upload, answers 503 SlowDown, loses and cuts responses. A checkpoint lands
complete or the upload reports failure; never a manifest over incomplete data, never an
incomplete multipart upload left open."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from runner.checkpoint.layout import manifest_key
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_checkpoint
from runner.errors import StorageTransientError
from runner.metrics.registry import RunnerMetrics
from runner.mirror import Mirror, resolve_resume, upload_checkpoint
from runner.storage.retry import RetryPolicy
from runner.storage.s3 import S3Storage
from runner.storage.s3_transfer import MiB, TransferSettings
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.fault_proxy import (
    CUT_RESPONSE,
    DROP_MID_BODY,
    LOSE_RESPONSE,
    SLOW_DOWN,
    FaultProxy,
    Request,
)
from tests.fixtures.s3 import SeaweedS3

pytestmark = pytest.mark.e2e

FAST_RETRY = RetryPolicy(attempts=4, initial_wait_s=0.05, max_wait_s=0.2)
SMALL_PARTS = TransferSettings(
    part_size=5 * MiB,
    multipart_threshold=5 * MiB,
    concurrency=3,
    request_attempts=2,
    read_timeout_s=10,
)


def stores(
    s3: SeaweedS3, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> tuple[S3Storage, S3Storage]:
    """(through the fault proxy, straight to the server) for one fresh bucket."""
    bucket = s3.create_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    faulty = S3Storage.from_uri(f"s3://{bucket}/run", settings=SMALL_PARTS, retry=FAST_RETRY)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3.endpoint)
    direct = S3Storage.from_uri(f"s3://{bucket}/run")
    return faulty, direct


@pytest.mark.slow
def test_fake_faults_mid_upload_still_land_a_complete_checkpoint(
    s3_env: SeaweedS3, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    faulty, direct = stores(s3_env, fault_proxy, monkeypatch)

    def plan(req: Request) -> str | None:
        if req.operation == "UploadPart" and req.count == 2:
            return DROP_MID_BODY
        if req.operation == "UploadPart" and req.count % 3 == 0:
            return SLOW_DOWN
        if req.operation == "PutObject" and req.count == 1:
            return DROP_MID_BODY
        if req.operation == "CompleteMultipartUpload" and req.count == 1:
            return SLOW_DOWN
        if req.operation == "PutManifest" and req.count == 1:
            return LOSE_RESPONSE  # the server stores it; the client never hears back
        return None

    fault_proxy.plan = plan
    ckpt = make_checkpoint(tmp_path / "run", 100, size=12 * MiB)
    upload_checkpoint(faulty, ckpt.path, writer_id="pod-a")

    faults = fault_proxy.injected_faults()
    assert faults[DROP_MID_BODY] >= 2 and faults[SLOW_DOWN] >= 2 and faults[LOSE_RESPONSE] == 1
    assert verify_checkpoint(direct, 100).fingerprint == ckpt.manifest.fingerprint
    assert direct.list_incomplete_uploads() == ()
    # one attempt directory only: retries never mixed two uploads
    attempts = {o.key.split("/")[2] for o in direct.list("checkpoints/step_000100/")}
    assert len(attempts - {"manifest.json"}) == 1


@pytest.mark.slow
def test_an_upload_that_keeps_failing_reports_failure_and_leaves_no_manifest(
    s3_env: SeaweedS3, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    faulty, direct = stores(s3_env, fault_proxy, monkeypatch)
    fault_proxy.plan = lambda req: DROP_MID_BODY if req.operation == "UploadPart" else None
    ckpt = make_checkpoint(tmp_path / "run", 200, size=12 * MiB)
    with pytest.raises(StorageTransientError):
        upload_checkpoint(faulty, ckpt.path)
    assert fault_proxy.injected_faults()[DROP_MID_BODY] >= FAST_RETRY.attempts
    assert list_checkpoints(direct) == []
    assert list(direct.list()) == []  # the attempt's small objects were removed too
    assert direct.list_incomplete_uploads() == ()  # every multipart upload aborted


@pytest.mark.slow
def test_final_upload_against_a_store_answering_503_reports_not_landed(
    s3_env: SeaweedS3,
    fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    faulty, direct = stores(s3_env, fault_proxy, monkeypatch)
    fault_proxy.plan = lambda req: SLOW_DOWN if req.method == "PUT" else None
    registry = CollectorRegistry()
    mirror = Mirror(faulty, keep=2, writer_id="pod-a", metrics=RunnerMetrics(registry))
    caplog.set_level(logging.INFO, logger="runner.mirror")
    try:
        landed = mirror.upload_now(
            make_checkpoint(tmp_path / "run", 300), deadline=time.monotonic() + 30
        )
    finally:
        mirror.close(timeout=30)
    assert landed is False
    assert "final checkpoint step 300 did NOT reach" in caplog.text
    assert "SlowDown" in caplog.text
    assert registry.get_sample_value(
        "runner_checkpoint_failures_total", {"stage": "upload"}
    ) == pytest.approx(1.0)
    with pytest.raises(FileNotFoundError):
        direct.head(manifest_key(300))


@pytest.mark.slow
def test_resume_through_cut_downloads_still_verifies(
    s3_env: SeaweedS3, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    faulty, direct = stores(s3_env, fault_proxy, monkeypatch)
    ckpt = make_checkpoint(tmp_path / "run", 400, size=12 * MiB)
    upload_checkpoint(direct, ckpt.path)
    fault_proxy.plan = lambda req: (
        CUT_RESPONSE if req.operation == "GetObject" and req.count in (1, 3) else None
    )
    fresh = tmp_path / "fresh"
    resumed = resolve_resume(fresh, faulty)
    assert fault_proxy.injected_faults()[CUT_RESPONSE] == 2
    assert resumed == fresh / "checkpoints" / "step_000400"
    assert (resumed / "weights.bin").read_bytes() == (ckpt.path / "weights.bin").read_bytes()
