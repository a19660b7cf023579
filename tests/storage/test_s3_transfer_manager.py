"""One long-lived s3transfer manager per S3 storage, against the real SeaweedFS server: every
put_file / get_file of a storage shares it (its threads outlive a transfer and are reused),
a transfer under a store deadline gets its own, and `close` ends their threads without
waiting for a transfer that hangs (that one through the fault proxy: a fake, for the
silent endpoint a healthy server never gives)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from runner.atomicity.files import sha256_file as size_and_sha256
from runner.storage.retry import store_deadline
from runner.storage.s3 import S3Storage
from runner.storage.s3_transfer import MiB
from tests.fixtures.fault_proxy import HANG, FaultProxy, Request
from tests.fixtures.s3 import SMALL_PARTS, SeaweedS3

pytestmark = pytest.mark.e2e


def sha256_file(path: Path) -> str:
    return size_and_sha256(path)[1]


def payload(path: Path, size: int) -> Path:
    path.write_bytes((bytes(range(256)) * (size // 256 + 1))[:size])
    return path


@pytest.mark.slow
def test_every_transfer_of_a_storage_shares_one_manager_and_close_ends_its_threads(
    s3_bucket: str, tmp_path: Path
) -> None:
    storage = S3Storage(s3_bucket, "run", settings=SMALL_PARTS)
    big = payload(tmp_path / "big.bin", 11 * MiB)  # 3 parts: the request pool is used
    small = payload(tmp_path / "small.bin", 1000)
    seen: list[set[threading.Thread]] = []
    for n in range(3):
        storage.put_file(f"big-{n}", big, sha256=sha256_file(big))
        storage.put_file(f"small-{n}", small, sha256=sha256_file(small))
        storage.get_file(f"big-{n}", tmp_path / f"got-{n}", sha256=sha256_file(big))
        seen.append(set(storage.transfers.threads()))
    assert storage.transfers.started == 1
    # the same threads serve every call and stay between calls: a manager per call would
    # have started new ones and ended them before returning
    assert seen[0] and seen[0] == seen[1] == seen[2], seen
    assert all(t.daemon and t.name.startswith("s3-transfer-") for t in seen[0])
    storage.close()
    assert not any(t.is_alive() for t in seen[0])
    assert storage.transfers.threads() == []
    # still usable: a later transfer builds a new manager
    storage.put_file("after-close", small, sha256=sha256_file(small))
    assert storage.transfers.started == 2
    assert storage.get_bytes("after-close") == small.read_bytes()
    again = storage.transfers.threads()
    storage.close()
    assert again and not any(t.is_alive() for t in again)


@pytest.mark.slow
def test_a_transfer_under_a_store_deadline_gets_its_own_manager(
    s3_bucket: str, tmp_path: Path
) -> None:
    storage = S3Storage(s3_bucket, "run", settings=SMALL_PARTS)
    small = payload(tmp_path / "small.bin", 1000)
    storage.put_file("periodic", small)
    with store_deadline(time.monotonic() + 60):
        storage.put_file("final", small)
        storage.put_file("final-2", small)
    assert storage.transfers.started == 2
    threads = storage.transfers.threads()
    assert {t.name.startswith("s3-transfer-deadline-") for t in threads} == {True, False}
    storage.close()
    assert not any(t.is_alive() for t in threads)


@pytest.mark.slow
def test_fake_silent_endpoint_close_does_not_wait_for_a_hung_transfer(
    s3_env: SeaweedS3,
    fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    bucket = s3_env.create_bucket()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", fault_proxy.endpoint)
    # 20 s: each hung request is given up on after about 13 s, far longer than close takes
    storage = S3Storage(bucket, "run", store_timeout_s=20)
    src = payload(tmp_path / "small.bin", 1000)
    storage.put_file("before", src)  # the manager and its threads exist
    fault_proxy.plan = lambda request: HANG if request.operation == "PutObject" else None
    outcome: list[BaseException | None] = []

    def upload() -> None:
        try:
            storage.put_file("hung", src)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=upload, name="hung-upload", daemon=True)
    worker.start()
    until = time.monotonic() + 10
    while not fault_proxy.injected_faults() and time.monotonic() < until:
        time.sleep(0.01)

    assert fault_proxy.injected_faults(), "the upload never reached the proxy"
    started = time.monotonic()
    storage.close()
    took = time.monotonic() - started
    assert took < 1.0, took
    assert worker.is_alive() and not outcome  # still hung: close did not wait for it

    def no_fault(request: Request) -> None:
        return None

    fault_proxy.plan = no_fault
    worker.join(60)  # its request times out; the retry lands on a new manager
    assert outcome == [None], outcome
    assert storage.get_bytes("hung") == src.read_bytes()
    storage.close()
