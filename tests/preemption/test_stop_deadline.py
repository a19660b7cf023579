"""A preempted runner exits by its deadline even when the mirror stops answering.

The endpoint goes bad mid-run through the fault proxy (a fake, for faults a real server
will not produce on demand): every request hangs unanswered, or every request gets 503
SlowDown. Uploads then retry for far longer than any notice period; the runner must give up
on them at the deadline, exit 75 with the final checkpoint committed locally, and leave the
bucket holding only complete checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.loss_log import LossLog
from runner.checkpoint.verify import verify_checkpoint
from runner.storage.s3 import S3Storage
from tests.fixtures.demo_process import checkpoint_steps
from tests.fixtures.fault_proxy import HANG, SLOW_DOWN, FaultProxy
from tests.fixtures.s3 import SeaweedS3

pytestmark = pytest.mark.e2e

GRACE_S = 4.0


def wait_until(what: str, proc: subprocess.Popen[str], check: Callable[[], object]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if check():
            return
        if proc.poll() is not None:
            pytest.fail(f"demo exited {proc.returncode} before {what}: {proc.communicate()[0]}")
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


EVERY_REQUEST = None
# Payload writes only: the upload then blocks inside the transfer's thread pool, whose workers
# the interpreter joins at exit even when they are daemon threads.
WRITES = frozenset({"PutObject", "UploadPart", "PutManifest", "CreateMultipartUpload"})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "operations"),
    [(HANG, EVERY_REQUEST), (HANG, WRITES), (SLOW_DOWN, EVERY_REQUEST)],
    ids=["hang-every-request", "hang-writes", "503-every-request"],
)
def test_sigterm_exits_by_the_deadline_when_the_mirror_stops_answering(
    fault: str,
    operations: frozenset[str] | None,
    s3_server: SeaweedS3,
    fault_proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = s3_server.create_bucket()
    location = f"s3://{bucket}/run"
    run_dir = tmp_path / "run"
    env = {**os.environ, **s3_server.env(), "AWS_ENDPOINT_URL_S3": fault_proxy.endpoint}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "runner", "demo", "--run-dir", str(run_dir)),
            *("--mirror", location, "--steps", "1000000", "--ckpt-every", "5"),
            *("--grace-seconds", str(GRACE_S), "--device", "cpu", "--threads", "1"),
            *("--metrics-port", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        for name, value in s3_server.env().items():
            monkeypatch.setenv(name, value)
        remote = S3Storage.from_uri(location)  # straight to the server, not via the proxy
        wait_until("a checkpoint in the bucket", proc, lambda: list_checkpoints(remote))
        fault_proxy.plan = lambda request: (
            fault if operations is None or request.operation in operations else None
        )
        # a periodic upload is now stuck on the bad endpoint
        wait_until("an upload to meet the fault", proc, lambda: fault_proxy.injected_faults())
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running 60 s after SIGTERM:\n{proc.communicate()[0][-4000:]}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    assert proc.returncode == 75, out[-3000:]
    # the grace period, plus the step in progress and interpreter exit (without the bounded
    # close and exit this took 26 s against 503s and minutes against a silent endpoint)
    assert took < GRACE_S + 6, f"exited {took:.1f}s after SIGTERM:\n{out[-3000:]}"
    reached = max(LossLog(run_dir).read())
    assert checkpoint_steps(run_dir)[-1] == reached
    assert "local only (mirror upload did NOT land)" in out, out[-3000:]
    assert "abandoning upload" in out or "did NOT reach" in out
    # what the bucket holds is complete: manifests go last
    steps = list_checkpoints(remote)
    assert steps and steps[-1] < reached
    for step in steps:
        verify_checkpoint(remote, step)
