"""Chunk digests (runner.checkpoint.chunk_digests): the writer lists the sha256 of every chunk
of a file beside its whole-file sha256, computed in the pass that wrote it; verification
checks the chunks on several threads. A corrupt chunk, a truncated file and swapped chunks
are refused (exit 3, the resume walk falls back), a malformed list is a corrupt manifest, a
checkpoint written without chunk digests still verifies and loads, and one written with them
keeps every field an older runner checks (schema, whole-file sha256).

The chunks are made small (64 KiB) so that a test state spans several of them."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runner.atomicity import chunk_hash
from runner.atomicity.chunk_hash import ChunkHasher, hash_file_chunks
from runner.checkpoint.chunk_digests import CHUNK_FIELD
from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import FORMAT_SEED_BIN, Manifest
from runner.checkpoint.payload import STATE_FILE
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CheckpointWriter, CommittedCheckpoint
from runner.errors import EXIT_INTEGRITY, IntegrityError
from runner.mirror.resume import choose_resume
from runner.session.checkpointer import Checkpointer
from tests.fixtures.ckpt import meta_for, state_fingerprint, tiny_train_state

CHUNK = 64 * 1024


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_hash, "CHUNK_DIGEST_BYTES", CHUNK)


def save(run_dir: Path, step: int) -> CommittedCheckpoint:
    """A torch-state checkpoint of ~350 KB: several chunks."""
    state = tiny_train_state(seed=step, steps=step, width=4096)
    writer = CheckpointWriter(run_dir / "checkpoints", run_id="r", writer_id="w")
    return writer.write_state(state, meta=meta_for(state, fingerprint=state_fingerprint(state)))


def manifest_json(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_bytes())


def listed_digests(step_dir: Path, name: str = STATE_FILE) -> list[str]:
    return manifest_json(step_dir)["extra"][CHUNK_FIELD]["files"][name]


def slices(data: bytes) -> list[bytes]:
    return [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_writer_lists_each_chunks_sha256_beside_the_fields_older_runners_check(
    tmp_path: Path,
) -> None:
    step_dir = save(tmp_path / "run", 2).path
    data = (step_dir / STATE_FILE).read_bytes()
    raw = manifest_json(step_dir)
    assert len(data) > 4 * CHUNK
    assert raw["extra"][CHUNK_FIELD]["chunk_bytes"] == CHUNK
    assert listed_digests(step_dir) == [hashlib.sha256(s).hexdigest() for s in slices(data)]
    # what a runner that knows no chunk digests reads is as before: schema 2, {path, size,
    # sha256} per file, the sha256 of the whole file
    assert raw["schema"] == "2"
    (entry,) = raw["files"]
    assert entry == {
        "path": STATE_FILE,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_a_corrupt_chunk_is_refused_naming_it_and_runner_verify_exits_3(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    step_dir = save(run_dir, 2).path
    flip(step_dir / STATE_FILE, 3 * CHUNK + 17)
    with pytest.raises(IntegrityError, match=r"sha256 mismatch in chunk 3 \(bytes 196608-262143\)"):
        verify_dir(step_dir)
    with pytest.raises(IntegrityError, match="in chunk 3"):
        load_state(step_dir)
    with pytest.raises(IntegrityError, match="in chunk 3"):
        load_state(step_dir, mmap=True)
    done = subprocess.run(
        [sys.executable, "-m", "runner", "verify", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EXIT_INTEGRITY, done.stdout + done.stderr
    assert "in chunk 3" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_swapped_chunks_and_a_truncated_file_are_refused(tmp_path: Path) -> None:
    swapped = save(tmp_path / "a", 2).path / STATE_FILE
    parts = slices(swapped.read_bytes())
    assert parts[1] != parts[2]
    parts[1], parts[2] = parts[2], parts[1]
    swapped.write_bytes(b"".join(parts))
    with pytest.raises(IntegrityError, match="sha256 mismatch in chunk 1 "):
        verify_dir(swapped.parent)

    truncated = save(tmp_path / "b", 2).path / STATE_FILE
    data = truncated.read_bytes()
    truncated.write_bytes(data[: 2 * CHUNK])
    with pytest.raises(IntegrityError, match="truncated or replaced"):
        verify_dir(truncated.parent)


def test_the_resume_walk_falls_back_past_a_corrupt_chunk(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    save(run_dir, 3)
    flip(save(run_dir, 5).path / STATE_FILE, 2 * CHUNK)
    skipped: list[tuple[int, str]] = []
    point = choose_resume(
        run_dir, None, load=Checkpointer.read, on_skip=lambda s, why: skipped.append((s, why))
    )
    assert point is not None and point.step == 3
    assert point.loaded["counters"]["step"] == 3
    assert [s for s, _ in skipped] == [5]
    assert "sha256 mismatch in chunk 2 " in skipped[0][1]


def test_a_checkpoint_without_chunk_digests_verifies_and_loads_by_its_sha256(
    tmp_path: Path,
) -> None:
    """As written before chunk digests existed: the same files, no `chunk_sha256`."""
    step_dir = save(tmp_path / "run", 2).path
    raw = manifest_json(step_dir)
    del raw["extra"][CHUNK_FIELD]
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    saved = torch.load(step_dir / STATE_FILE, weights_only=True, map_location="cpu")
    verify_dir(step_dir)
    loaded = load_state(step_dir)
    for name, tensor in saved["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    flip(step_dir / STATE_FILE, 3 * CHUNK)
    with pytest.raises(IntegrityError, match=r"sha256 mismatch \(the file is corrupt\)"):
        verify_dir(step_dir)


def _with_chunks(step_dir: Path, field: object) -> bytes:
    raw = manifest_json(step_dir)
    raw["extra"][CHUNK_FIELD] = field
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "change",
    [
        "one digest short",
        "one digest too many",
        "a malformed digest",
        "an unlisted file",
        "chunk_bytes too small",
        "chunk_bytes a bool",
        "chunk_bytes another size",
        "not an object",
        "an unknown key",
    ],
)
def test_a_malformed_chunk_list_is_a_corrupt_manifest(tmp_path: Path, change: str) -> None:
    step_dir = save(tmp_path / "run", 2).path
    field = manifest_json(step_dir)["extra"][CHUNK_FIELD]
    digests = field["files"][STATE_FILE]
    if change == "one digest short":
        field["files"][STATE_FILE] = digests[:-1]
    elif change == "one digest too many":
        field["files"][STATE_FILE] = [*digests, digests[0]]
    elif change == "a malformed digest":
        field["files"][STATE_FILE] = [*digests[:-1], digests[-1].upper()]
    elif change == "an unlisted file":
        field["files"]["other.pt"] = digests
    elif change == "chunk_bytes too small":
        field["chunk_bytes"] = 1
    elif change == "chunk_bytes a bool":
        field["chunk_bytes"] = True
    elif change == "chunk_bytes another size":
        field["chunk_bytes"] = CHUNK * 2  # the count no longer matches the file's size
    elif change == "not an object":
        field = digests
    else:
        field["by"] = "me"
    with pytest.raises(IntegrityError, match=f"extra.{CHUNK_FIELD} .*the manifest is corrupt"):
        Manifest.from_json(_with_chunks(step_dir, field))


def test_adopted_and_copied_files_get_chunk_digests_from_their_one_read(tmp_path: Path) -> None:
    payload = hashlib.sha256(b"seed").digest() * (5 * CHUNK // 32 + 7)
    src = tmp_path / "src"
    src.mkdir()
    (src / "moved.bin").write_bytes(payload)
    (src / "copied.bin").write_bytes(payload[::-1])
    (src / "small.bin").write_bytes(payload[:100])
    writer = CheckpointWriter(tmp_path / "run" / "checkpoints", run_id="r", writer_id="w")
    state = tiny_train_state()
    meta = meta_for(state)
    moved = writer.adopt_files(
        {"moved.bin": src / "moved.bin", "small.bin": src / "small.bin"},
        meta=meta,
        format=FORMAT_SEED_BIN,
    )
    files = manifest_json(moved.path)["extra"][CHUNK_FIELD]["files"]
    assert set(files) == {"moved.bin"}  # a file of one chunk is checked by its sha256
    assert files["moved.bin"] == [hashlib.sha256(s).hexdigest() for s in slices(payload)]

    copied = writer.adopt_files(
        {"copied.bin": src / "copied.bin"},
        meta=meta_for(tiny_train_state(steps=4)),
        format=FORMAT_SEED_BIN,
        copy=True,
    )
    expected = [hashlib.sha256(s).hexdigest() for s in slices(payload[::-1])]
    assert listed_digests(copied.path, "copied.bin") == expected
    flip(copied.path / "copied.bin", len(payload) - 1)
    with pytest.raises(IntegrityError, match=f"in chunk {len(expected) - 1} "):
        verify_dir(copied.path)


def test_chunk_digests_do_not_depend_on_how_the_bytes_were_split() -> None:
    data = bytes(range(256)) * (3 * CHUNK // 256 + 5)
    expected = [hashlib.sha256(s).hexdigest() for s in slices(data)]
    for piece in (1000, CHUNK, CHUNK + 1, len(data)):
        hasher = ChunkHasher()
        for i in range(0, len(data), piece):
            hasher.update(data[i : i + piece])
        assert hasher.digests() == expected
    hasher = ChunkHasher()
    hasher.update(memoryview(torch.frombuffer(bytearray(data), dtype=torch.float32).numpy()))
    assert hasher.digests() == expected  # a typed buffer is hashed by its bytes
    one = ChunkHasher()
    one.update(data[:CHUNK])
    assert one.digests() is None  # one chunk: the whole-file sha256 says it all


def test_hash_file_chunks_gives_the_whole_and_the_chunk_digests(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = hashlib.sha256(b"x").digest() * (2 * CHUNK // 32 + 3)
    path.write_bytes(data)
    size, sha256, chunks = hash_file_chunks(path)
    assert (size, sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert chunks == [hashlib.sha256(s).hexdigest() for s in slices(data)]


def test_a_refusal_does_not_wait_for_the_other_chunks_to_be_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunk 0 of a 300-chunk file is corrupt: the chunks not started yet are never read."""
    payload = hashlib.sha256(b"big").digest() * (300 * CHUNK // 32)
    src = tmp_path / "big.bin"
    src.write_bytes(payload)
    writer = CheckpointWriter(tmp_path / "run" / "checkpoints", run_id="r", writer_id="w")
    step_dir = writer.adopt_files(
        {"big.bin": src}, meta=meta_for(tiny_train_state()), format=FORMAT_SEED_BIN
    ).path
    flip(step_dir / "big.bin", 10)
    from runner.checkpoint import verify

    opened: list[str] = []
    real_open = verify.open_local

    def counting_open(where: Path, rel: str):  # type: ignore[no-untyped-def]
        opened.append(rel)
        if len(opened) > 2:
            time.sleep(0.01)  # 300 chunks would take 3 s: the refusal must not wait for them
        return real_open(where, rel)

    monkeypatch.setattr(verify, "open_local", counting_open)
    monkeypatch.setattr(verify.os, "cpu_count", lambda: 2)
    with pytest.raises(IntegrityError, match="in chunk 0 "):
        verify_dir(step_dir, counters=False)
    assert len(listed_digests(step_dir, "big.bin")) == 300
    assert 1 <= len(opened) < 100, len(opened)
