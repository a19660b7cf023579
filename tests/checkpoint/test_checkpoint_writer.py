"""Commit protocol: layout, manifest last, one-pass hashing, duplicates, leftovers, shards."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from runner.atomicity import files as atomic
from runner.atomicity.files import PARALLEL_HASH_MIN, HashingFileWriter
from runner.checkpoint.load import load_state
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CheckpointWriter
from runner.errors import CheckpointConflictError, IntegrityError
from tests.fixtures.ckpt import meta_for, state_fingerprint, tiny_train_state, tree_hashes


def _writer(tmp_path: Path, **kwargs: object) -> CheckpointWriter:
    return CheckpointWriter(tmp_path / "checkpoints", run_id="r1", writer_id="w1", **kwargs)  # type: ignore[arg-type]


def test_write_state_commits_a_verified_directory_with_manifest_fields(tmp_path: Path) -> None:
    state = tiny_train_state(steps=3)
    fp = state_fingerprint(state)
    ckpt = _writer(tmp_path).write_state(state, meta=meta_for(state, fingerprint=fp))

    assert ckpt.path == tmp_path / "checkpoints" / "step_000003"
    assert sorted(p.name for p in ckpt.path.iterdir()) == ["manifest.json", "state.pt"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000003"]
    manifest = json.loads((ckpt.path / "manifest.json").read_bytes())
    payload = (ckpt.path / "state.pt").read_bytes()
    assert manifest["files"] == [
        {"path": "state.pt", "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    ]
    assert {k: manifest[k] for k in ("schema", "step", "samples_seen", "world_size")} == {
        "schema": "2",  # torch-state: the lowest schema that expresses it
        "step": 3,
        "samples_seen": 15,
        "world_size": 1,
    }
    assert (manifest["run_id"], manifest["writer"], manifest["format"]) == (
        "r1",
        "w1",
        "torch-state",
    )
    assert manifest["fingerprint"] == fp
    loaded = load_state(ckpt.path)
    assert loaded["schema"] == "2"
    assert state_fingerprint(loaded) == fp
    assert loaded["loss_history"] == state["loss_history"]


def test_hashing_writer_parallel_hash_matches_file(tmp_path: Path) -> None:
    big = os.urandom(PARALLEL_HASH_MIN * 3 + 17)
    with HashingFileWriter(tmp_path / "f") as out:
        out.write(b"head")
        out.write(big)
        out.write(memoryview(big)[:5])
        out.commit()
    data = (tmp_path / "f").read_bytes()
    assert data == b"head" + big + big[:5]
    assert (out.size, out.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_writeback_starts_while_writing_and_covers_every_byte_before_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel is asked (really: sync_file_range) to write each 32 MiB as it is produced,
    so the final fsync only waits for the tail."""
    real = atomic._sync_file_range
    assert real is not None, "sync_file_range must be available on Linux"
    calls: list[tuple[int, int, int]] = []

    def recording(fd: int, offset: int, nbytes: int, flags: int) -> int:
        rc = real(fd, offset, nbytes, flags)
        calls.append((offset, nbytes, rc))
        return rc

    monkeypatch.setattr(atomic, "_sync_file_range", recording)
    chunk = os.urandom(atomic.WRITEBACK_EVERY // 4 + 1)
    with HashingFileWriter(tmp_path / "f") as out:
        for _ in range(9):
            out.write(chunk)
        hinted_before_commit = list(calls)
        out.commit()
    assert len(hinted_before_commit) == 2
    assert [rc for _, _, rc in calls] == [0, 0]  # the real syscall accepted each range
    covered = 0
    for offset, nbytes, _ in hinted_before_commit:
        assert offset == covered and nbytes >= atomic.WRITEBACK_EVERY
        covered += nbytes
    assert (tmp_path / "f").read_bytes() == chunk * 9


def test_same_step_same_state_keeps_the_existing_checkpoint(tmp_path: Path) -> None:
    state = tiny_train_state(steps=2)
    meta = meta_for(state, fingerprint=state_fingerprint(state))
    first = _writer(tmp_path).write_state(state, meta=meta)
    created = json.loads((first.path / "manifest.json").read_bytes())["created_at"]
    again = _writer(tmp_path).write_state(state, meta=meta)
    assert json.loads((first.path / "manifest.json").read_bytes())["created_at"] == created
    assert again.manifest.created_at == created
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002"]


def test_same_step_other_state_never_replaces_a_verified_checkpoint(tmp_path: Path) -> None:
    a, b = tiny_train_state(seed=1, steps=2), tiny_train_state(seed=2, steps=2)
    first = _writer(tmp_path).write_state(a, meta=meta_for(a, fingerprint=state_fingerprint(a)))
    before = tree_hashes(first.path)
    with pytest.raises(CheckpointConflictError, match="never replaced") as caught:
        _writer(tmp_path).write_state(b, meta=meta_for(b, fingerprint=state_fingerprint(b)))
    assert tree_hashes(first.path) == before  # the verified checkpoint is untouched
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000002"]
    # the save that lost is not thrown away either: it is kept aside, complete
    (kept,) = (tmp_path / "aside").iterdir()
    assert kept.name.startswith("step_000002-") and kept.name.endswith("-not-committed")
    assert str(kept) in str(caught.value)
    assert verify_dir(kept).fingerprint == state_fingerprint(b)


def test_corrupt_existing_step_is_set_aside_not_deleted(tmp_path: Path) -> None:
    state = tiny_train_state(steps=2)
    meta = meta_for(state, fingerprint=state_fingerprint(state))
    ckpt = _writer(tmp_path).write_state(state, meta=meta)
    (ckpt.path / "state.pt").write_bytes(b"garbage")
    corrupt = tree_hashes(ckpt.path)
    _writer(tmp_path).write_state(state, meta=meta)
    assert verify_dir(ckpt.path).fingerprint == meta.fingerprint
    (aside,) = (tmp_path / "aside").iterdir()
    assert aside.name.startswith("step_000002-") and aside.name.endswith("-corrupt")
    assert tree_hashes(aside) == corrupt


def test_failed_save_leaves_previous_checkpoint_and_no_temp(tmp_path: Path) -> None:
    good = tiny_train_state(steps=1)
    writer = _writer(tmp_path)
    writer.write_state(good, meta=meta_for(good))
    bad = {**tiny_train_state(steps=2), "extra": {"oops": threading.Lock()}}
    with pytest.raises(TypeError):
        writer.write_state(bad, meta=meta_for(bad))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


def test_write_state_does_not_mutate_the_callers_state(tmp_path: Path) -> None:
    state = tiny_train_state(steps=1)
    del state["schema"]
    before = set(state)
    ckpt = _writer(tmp_path).write_state(state, meta=meta_for(state))
    assert set(state) == before
    assert load_state(ckpt.path)["schema"] == "2"


def test_concurrent_background_writes_all_commit(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    states = [tiny_train_state(seed=i, steps=i) for i in range(1, 5)]
    errors: list[BaseException] = []

    def save(state: dict) -> None:
        try:
            writer.write_state(state, meta=meta_for(state, fingerprint=state_fingerprint(state)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(s,)) for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for state in states:
        step_dir = tmp_path / "checkpoints" / f"step_{state['counters']['step']:06d}"
        assert state_fingerprint(load_state(step_dir)) == state_fingerprint(state)


def test_cleanup_removes_own_and_dead_leftovers_but_not_a_live_writer(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    writer = _writer(tmp_path, stale_seconds=1.0)
    mine = ckpts / f".tmp-step_000005-{os.getpid()}-aaaaaaaaaaaa"
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dead_old = ckpts / f".tmp-step_000006-{dead_pid}-bbbbbbbbbbbb"
    dead_fresh = ckpts / f".tmp-step_000007-{dead_pid}-cccccccccccc"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live_old = ckpts / f".tmp-step_000008-{live.pid}-dddddddddddd"
        for d in (mine, dead_old, dead_fresh, live_old):
            d.mkdir()
            (d / "state.pt").write_bytes(b"partial")
        old = time.time() - 5
        for d in (dead_old, live_old):
            os.utime(d / "state.pt", (old, old))
            os.utime(d, (old, old))
        removed = writer.cleanup_partial()
        assert sorted(p.name for p in removed) == sorted([mine.name, dead_old.name])
        assert dead_fresh.exists() and live_old.exists()
    finally:
        live.kill()
        live.wait()


class _PausingDict(dict):
    """A state whose pickling pauses mid-save until released (fault injection: a slow write)."""

    def __init__(self, data: dict, started: threading.Event, release: threading.Event) -> None:
        super().__init__(data)
        self._events = (started, release)

    def __reduce_ex__(self, protocol):  # type: ignore[no-untyped-def]
        started, release = self._events
        started.set()
        release.wait(10)
        return (dict, (dict(self),))


def test_cleanup_never_touches_a_write_in_progress_in_this_process(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    other = _writer(tmp_path)
    state = tiny_train_state(steps=1)
    started, release = threading.Event(), threading.Event()
    seen: list[list[str]] = []

    def save() -> None:
        writer.write_state(_PausingDict(state, started, release), meta=meta_for(state))

    t = threading.Thread(target=save)
    t.start()
    assert started.wait(10)
    removed = other.cleanup_partial()
    seen.append([p.name for p in (tmp_path / "checkpoints").iterdir()])
    release.set()
    t.join()
    assert removed == []
    assert len(seen[0]) == 1 and seen[0][0].startswith(".tmp-step_000001-")
    # counters=False: the payload is a dict subclass (the pause hook), which weights-only
    # loading refuses; only the files are what this test checks
    assert verify_dir(tmp_path / "checkpoints" / "step_000001", counters=False).step == 1


def test_chunked_layout_indexes_every_chunk_and_round_trips(tmp_path: Path) -> None:
    state = tiny_train_state(steps=2, width=64)
    fp = state_fingerprint(state)
    ckpt = _writer(tmp_path, chunk_bytes=1024).write_state(
        state, meta=meta_for(state, fingerprint=fp)
    )
    assert ckpt.manifest.format == "torch-chunked"
    assert json.loads((ckpt.path / "manifest.json").read_bytes())["schema"] == "3"
    index = json.loads((ckpt.path / "index.json").read_bytes())
    assert (index["schema"], "shards" in index) == ("2", False)
    listed = {f.path: (f.size, f.sha256) for f in ckpt.manifest.files}
    shard_names = [s["path"] for s in index["chunks"]]
    assert len(shard_names) >= 3
    assert shard_names == [f"chunk_{i:05d}.pt" for i in range(len(shard_names))]
    assert set(listed) == {*shard_names, "index.json", "skeleton.pt"}
    for shard in index["chunks"]:
        data = (ckpt.path / shard["path"]).read_bytes()
        assert (shard["size"], shard["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
        assert listed[shard["path"]] == (shard["size"], shard["sha256"])
        assert set(torch.load(ckpt.path / shard["path"], weights_only=True)) == set(
            shard["tensors"]
        )
    assert sum(len(s["tensors"]) for s in index["chunks"]) == 4 + 3 * 4 + 1
    loaded = load_state(ckpt.path)
    assert state_fingerprint(loaded) == fp
    assert loaded["counters"] == state["counters"]
    assert list(loaded["model"]) == list(state["model"])


def test_small_state_stays_one_file_below_chunk_bytes(tmp_path: Path) -> None:
    state = tiny_train_state(steps=1)
    ckpt = _writer(tmp_path, chunk_bytes=1 << 30).write_state(state, meta=meta_for(state))
    assert ckpt.manifest.format == "torch-state"


def test_our_saves_skip_zip_crc32_and_a_concurrent_user_torch_save_keeps_it(
    tmp_path: Path,
) -> None:
    """Our saves write no zip CRC32 (the manifest's sha256 covers every byte); a torch.save
    the user's code runs on another thread meanwhile still writes it: torch's process-wide
    switch is never flipped (it used to be, for the duration of each of our saves)."""
    import threading
    import zipfile

    from torch.utils.serialization import config

    assert config.save.compute_crc32 is True
    big = {"w": torch.randn(4_000_000)}  # 16 MB: each of our saves takes a while
    stop = threading.Event()
    ours: list[Path] = []

    def save_ours() -> None:
        from runner.checkpoint.staging import Staging

        stage = Staging(tmp_path / "stage")
        while not stop.is_set():
            name = f"ours_{len(ours)}.pt"
            stage.write_torch(name, big)
            ours.append(stage.path / name)

    saver = threading.Thread(target=save_ours)
    saver.start()
    try:
        while not ours:
            time.sleep(0.001)
        for i in range(40):  # the user's saves, while ours keep running
            path = tmp_path / f"user_{i}.pt"
            torch.save({"x": torch.arange(1000)}, path)
            with zipfile.ZipFile(path) as archive:
                assert archive.testzip() is None, f"user save {i} lost its CRC32"
    finally:
        stop.set()
        saver.join()
    assert config.save.compute_crc32 is True
    with zipfile.ZipFile(ours[0]) as archive:
        assert archive.testzip() is not None  # no CRC32 in ours ...
    assert torch.equal(torch.load(ours[0], weights_only=True)["w"], big["w"])  # ... loads


def test_adopt_moves_files_in_and_gives_them_back_on_failure(tmp_path: Path) -> None:
    from runner.checkpoint.writer import CheckpointMeta

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    src = ckpts / "step_000004.bin"
    src.write_bytes(b"seed bytes")
    meta = CheckpointMeta(
        step=4, samples_seen=0, world_size=0, epoch=0, batch_in_epoch=0, fingerprint=""
    )
    with pytest.raises(IntegrityError, match="world_size must be >= 1"):
        _writer(tmp_path).adopt_files({"step_000004.bin": src}, meta=meta, format="seed-bin")
    assert src.read_bytes() == b"seed bytes"
    assert [p.name for p in ckpts.iterdir()] == ["step_000004.bin"]
    good = CheckpointMeta(
        step=4, samples_seen=0, world_size=1, epoch=0, batch_in_epoch=0, fingerprint=""
    )
    ckpt = _writer(tmp_path).adopt_files({"step_000004.bin": src}, meta=good, format="seed-bin")
    assert not src.exists()
    # counters=False: "seed bytes" is no real seed header (its step would not be 4)
    listed = verify_dir(ckpt.path, counters=False).files[0]
    assert listed.sha256 == hashlib.sha256(b"seed bytes").hexdigest()
