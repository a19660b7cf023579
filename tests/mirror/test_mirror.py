"""Mirror protocol against file:// and a real SeaweedFS: upload (verified; that the manifest
goes last is proven call by call in test_upload_order.py), download (atomic, verified), resume
from local or remote, two concurrent writers, retention, background uploads."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest

from runner.checkpoint.layout import checkpoint_key, manifest_key
from runner.checkpoint.listing import list_checkpoints, read_manifest
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.verify import verify_checkpoint, verify_dir
from runner.checkpoint.writer import CommittedCheckpoint
from runner.errors import IntegrityError, StorageConflictError
from runner.mirror import (
    Mirror,
    download_checkpoint,
    remote_manifest,
    resolve_resume,
    upload_checkpoint,
)
from runner.mirror.remote_layout import ATTEMPT_FIELD, to_local
from runner.storage import Storage
from runner.storage.s3_transfer import MiB
from tests.fixtures.ckpt import make_checkpoint


@pytest.fixture
def remote(any_storage: Storage) -> Storage:
    return any_storage


def flip_byte(storage: Storage, key: str, tmp: Path) -> None:
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    storage.put_bytes(key, bytes(data))


def remote_payload_key(storage: Storage, step: int, name: str) -> str:
    manifest = read_manifest(storage, step)
    (path,) = [f.path for f in manifest.files if f.path.endswith("/" + name)]
    return f"{checkpoint_key(step)}/{path}"


def test_upload_then_download_is_byte_identical(remote: Storage, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "run", 100, size=6 * MiB + 3)
    uploaded = upload_checkpoint(remote, ckpt.path, writer_id="pod-a")

    # the mirror's manifest names files under this upload's own directory, and verifies
    attempt = uploaded.extra[ATTEMPT_FIELD]
    assert sorted(f.path for f in uploaded.files) == [
        f"{attempt}/extra.json",
        f"{attempt}/weights.bin",
    ]
    assert verify_checkpoint(remote, 100).fingerprint == ckpt.manifest.fingerprint
    assert list_checkpoints(remote) == [100]

    fresh = tmp_path / "fresh"
    step_dir = download_checkpoint(remote, 100, fresh)
    assert step_dir == fresh / "checkpoints" / "step_000100"
    for name in ("manifest.json", "weights.bin", "extra.json"):
        assert (step_dir / name).read_bytes() == (ckpt.path / name).read_bytes()
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["step_000100"]


def test_upload_of_a_checkpoint_already_there_sends_nothing(
    remote: Storage, tmp_path: Path
) -> None:
    ckpt = make_checkpoint(tmp_path / "run", 5)
    first = upload_checkpoint(remote, ckpt.path)
    again = upload_checkpoint(remote, ckpt.path)
    assert again.extra[ATTEMPT_FIELD] == first.extra[ATTEMPT_FIELD]
    assert len(list(remote.list(checkpoint_key(5) + "/"))) == 3


def test_a_corrupt_local_file_is_not_uploaded_and_leaves_no_manifest(
    remote: Storage, tmp_path: Path
) -> None:
    ckpt = make_checkpoint(tmp_path / "run", 7)
    data = bytearray((ckpt.path / "weights.bin").read_bytes())
    data[10] ^= 0xFF
    (ckpt.path / "weights.bin").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"weights\.bin"):
        upload_checkpoint(remote, ckpt.path)
    assert list(remote.list()) == []  # no manifest, and this attempt's objects removed


def test_two_writers_on_one_step_never_mix(remote: Storage, tmp_path: Path) -> None:
    """The old pod uploads its final checkpoint of step 300 while its replacement uploads a
    different step 300: exactly one wins, whole; the loser reports the conflict."""
    old = make_checkpoint(tmp_path / "old", 300, size=6 * MiB, seed=1, writer="pod-old")
    new = make_checkpoint(tmp_path / "new", 300, size=6 * MiB, seed=2, writer="pod-new")
    barrier = threading.Barrier(2)
    results: dict[str, object] = {}

    def upload(name: str, ckpt: CommittedCheckpoint) -> None:
        barrier.wait()
        try:
            results[name] = upload_checkpoint(remote, ckpt.path, writer_id=name)
        except StorageConflictError as exc:
            results[name] = exc

    threads = [
        threading.Thread(target=upload, args=("pod-old", old)),
        threading.Thread(target=upload, args=("pod-new", new)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    winners = [n for n, r in results.items() if isinstance(r, Manifest)]
    losers = [n for n, r in results.items() if isinstance(r, StorageConflictError)]
    assert len(winners) == 1 and len(losers) == 1, results
    won = {"pod-old": old, "pod-new": new}[winners[0]]
    stored = verify_checkpoint(remote, 300)
    assert to_local(stored).files == won.manifest.files
    assert stored.fingerprint == won.manifest.fingerprint
    attempt = stored.extra[ATTEMPT_FIELD]
    # nothing of the loser's attempt remains under the step
    assert {o.key.split("/")[2] for o in remote.list(checkpoint_key(300) + "/")} == {
        "manifest.json",
        attempt,
    }


def test_two_writers_with_the_same_state_both_succeed(remote: Storage, tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", 40, writer="pod-a")
    b = make_checkpoint(tmp_path / "b", 40, writer="pod-b")
    upload_checkpoint(remote, a.path, writer_id="pod-a")
    assert upload_checkpoint(remote, b.path, writer_id="pod-b").fingerprint == (
        a.manifest.fingerprint
    )


@pytest.mark.slow
def test_resume_from_an_empty_run_dir_falls_back_past_a_corrupt_newest(
    remote: Storage, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    for step in (10, 20):
        upload_checkpoint(remote, make_checkpoint(run, step).path)
    flip_byte(remote, remote_payload_key(remote, 20, "weights.bin"), tmp_path)

    skipped: list[tuple[int, str]] = []
    fresh = tmp_path / "fresh"
    resumed = resolve_resume(fresh, remote, on_skip=lambda s, why: skipped.append((s, why)))
    assert resumed == fresh / "checkpoints" / "step_000010"
    assert [s for s, _ in skipped] == [20]
    assert "sha256" in skipped[0][1] and remote.uri in skipped[0][1]
    assert (resumed / "weights.bin").read_bytes() == (
        run / "checkpoints" / "step_000010" / "weights.bin"
    ).read_bytes()
    # nothing of the corrupt download is left behind
    assert sorted(p.name for p in (fresh / "checkpoints").iterdir()) == ["step_000010"]


def test_resume_takes_the_newest_of_local_and_remote(remote: Storage, tmp_path: Path) -> None:
    run = tmp_path / "run"
    upload_checkpoint(remote, make_checkpoint(run, 10).path)
    upload_checkpoint(remote, make_checkpoint(run, 20).path)
    other = tmp_path / "other"
    make_checkpoint(other, 30)
    # local 30 is newer than anything remote: used as is
    assert resolve_resume(other, remote) == other / "checkpoints" / "step_000030"
    assert not (other / "checkpoints" / "step_000020").exists()
    # local 10 is older than remote 20: 20 is downloaded
    behind = tmp_path / "behind"
    make_checkpoint(behind, 10)
    assert resolve_resume(behind, remote) == behind / "checkpoints" / "step_000020"
    assert resolve_resume(tmp_path / "none", None) is None


def test_resume_examines_only_what_it_needs_and_replaces_a_corrupt_local_step(
    remote: Storage, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    upload_checkpoint(remote, make_checkpoint(run, 20).path)
    # a corrupt local 10 behind a good remote 20 is never hashed, so never reported
    behind = tmp_path / "behind"
    old = make_checkpoint(behind, 10)
    (old.path / "extra.json").write_bytes(b'{"step": 99}')
    skipped: list[tuple[int, str]] = []
    got = resolve_resume(behind, remote, on_skip=lambda s, why: skipped.append((s, why)))
    assert got == behind / "checkpoints" / "step_000020" and skipped == []
    # a corrupt local 20 with a good remote 20: reported, then replaced by the download
    same = tmp_path / "same"
    bad = make_checkpoint(same, 20)
    (bad.path / "extra.json").write_bytes(b'{"step": 99}')
    got = resolve_resume(same, remote, on_skip=lambda s, why: skipped.append((s, why)))
    assert got == bad.path
    assert [(s, why.split(":")[0]) for s, why in skipped] == [(20, "local")]
    assert (got / "extra.json").read_bytes() == b'{"step": 20}'
    verify_dir(got)


def test_mirror_uploads_in_background_keeps_k_and_newest_wins(
    remote: Storage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    mirror = Mirror(remote, keep=2, writer_id="pod-a")
    try:
        for step in (10, 20, 30):
            mirror.submit(make_checkpoint(run, step))
            assert mirror.wait_idle(timeout=60)
        assert list_checkpoints(remote) == [20, 30]  # keep=2
        assert mirror.last_uploaded == 30

        caplog.set_level(logging.INFO, logger="runner.mirror")
        caplog.clear()  # an earlier test may have left the runner loggers at INFO already
        ckpts = [make_checkpoint(run, step) for step in (40, 50, 60, 70)]
        for ckpt in ckpts:  # faster than uploads: superseded ones are skipped
            mirror.submit(ckpt)
        assert mirror.wait_idle(timeout=60)
        assert list_checkpoints(remote)[-1] == 70
        assert mirror.in_flight_steps() == set()
        skipped = {int(m) for m in re.findall(r"upload of step (\d+): superseded", caplog.text)}
        uploaded = {int(m) for m in re.findall(r"uploaded checkpoint step (\d+)", caplog.text)}
        assert skipped, "four quick submissions should supersede at least one"
        assert 70 in uploaded and skipped | uploaded == {40, 50, 60, 70}
        assert not skipped & uploaded
    finally:
        mirror.close()


def test_upload_now_reports_whether_the_final_checkpoint_landed(
    remote: Storage, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="runner.mirror")
    run = tmp_path / "run"
    mirror = Mirror(remote, keep=3, writer_id="pod-a")
    try:
        assert mirror.upload_now(make_checkpoint(run, 11), deadline=time.monotonic() + 60)
        assert "final checkpoint step 11 is durable" in caplog.text
        assert verify_checkpoint(remote, 11).step == 11

        # a deadline already passed: reported as not landed, never as durable
        late = make_checkpoint(run, 12, size=6 * MiB)
        assert mirror.upload_now(late, deadline=time.monotonic()) is False
        assert "final checkpoint step 12 did NOT reach" in caplog.text
    finally:
        mirror.close(timeout=60)


def test_a_manifest_in_the_mirror_that_mixes_attempts_is_refused(
    remote: Storage, tmp_path: Path
) -> None:
    ckpt = make_checkpoint(tmp_path / "run", 9)
    uploaded = upload_checkpoint(remote, ckpt.path)
    forged = Manifest.from_json(uploaded.to_json())
    forged.files[0] = type(forged.files[0])(
        path="up-other-writer/" + forged.files[0].path.split("/", 1)[1],
        size=forged.files[0].size,
        sha256=forged.files[0].sha256,
    )
    remote.put_bytes(manifest_key(9), forged.to_json())
    with pytest.raises(IntegrityError, match="mixes two uploads"):
        download_checkpoint(remote, 9, tmp_path / "fresh")
    assert remote_manifest(remote, 9) is not None
    assert not (tmp_path / "fresh" / "checkpoints" / "step_000009").exists()
