"""Loading deserialises beside the hashing (runner.checkpoint.load.read_beside_verify): what
it read is handed out only once every byte verified. A damaged payload is refused as corrupt
(exit 3, set aside as corrupt, the walk falls back to the older checkpoint), whether torch
could read the damaged bytes or not; a checkpoint written before this change still loads."""

from __future__ import annotations

import gc
import threading
import time
import weakref
import zipfile
from pathlib import Path

import pytest
import torch

from runner.checkpoint.load import load_state, read_beside_verify
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.payload import STATE_FILE
from runner.errors import IntegrityError, PayloadNotLoadableError
from runner.mirror.resume import choose_resume
from runner.session.checkpointer import Checkpointer
from tests.fixtures.ckpt import SaveCheckpoint, save_checkpoint  # noqa: F401


def _record_offset(path: Path, info: zipfile.ZipInfo) -> int:
    """Where a stored (uncompressed) zip record's bytes begin: past its local header."""
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len


def _pickle_offset(path: Path) -> int:
    """Where the state's pickle (torch's `*/data.pkl`, stored uncompressed) begins."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    return _record_offset(path, info)


def _largest_record(path: Path) -> tuple[int, int]:
    """(offset, size) of the largest tensor record in the state file."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    return _record_offset(path, info), info.file_size


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage(path: Path, how: str) -> None:
    if how == "pickle":  # torch cannot even read it: the pickle's protocol opcode is gone
        _flip(path, _pickle_offset(path))
    elif how == "tensor-bytes":  # torch reads it without complaint: only the hash can tell
        offset, size = _largest_record(path)
        _flip(path, offset + size // 2)
    elif how == "swapped":  # same size, same bytes, two halves of a record exchanged
        offset, size = _largest_record(path)
        half = size // 2
        data = bytearray(path.read_bytes())
        a, b = data[offset : offset + half], data[offset + half : offset + 2 * half]
        assert a != b
        data[offset : offset + 2 * half] = b + a
        path.write_bytes(bytes(data))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["pickle", "tensor-bytes", "swapped"])
def test_a_damaged_payload_is_refused_as_corrupt_never_as_unloadable(
    save_checkpoint: SaveCheckpoint,  # noqa: F811
    how: str,
) -> None:
    step_dir = save_checkpoint(5).path
    _damage(step_dir / STATE_FILE, how)
    with pytest.raises(IntegrityError, match="sha256 mismatch") as err:
        load_state(step_dir)
    assert not isinstance(err.value, PayloadNotLoadableError)


def test_a_truncated_payload_is_refused_before_torch_reads_it(
    save_checkpoint: SaveCheckpoint,  # noqa: F811
) -> None:
    step_dir = save_checkpoint(5).path
    path = step_dir / STATE_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(IntegrityError, match="truncated or replaced"):
        load_state(step_dir)


@pytest.mark.parametrize("how", ["pickle", "tensor-bytes", "swapped"])
def test_the_resume_walk_falls_back_past_a_damaged_newest_and_calls_it_corrupt(
    save_checkpoint: SaveCheckpoint,  # noqa: F811
    tmp_path: Path,
    how: str,
) -> None:
    run_dir = tmp_path / "run"
    save_checkpoint(3)
    _damage(save_checkpoint(5).path / STATE_FILE, how)
    skipped: list[tuple[int, str]] = []
    point = choose_resume(
        run_dir, None, load=Checkpointer.read, on_skip=lambda s, why: skipped.append((s, why))
    )
    assert point is not None and point.step == 3
    assert point.loaded["counters"]["step"] == 3
    assert [s for s, _ in skipped] == [5]
    assert "sha256 mismatch" in skipped[0][1] and "cannot be loaded" not in skipped[0][1]

    # alone, it is set aside as corrupt (not as foreign) by --fresh-start, bytes kept
    (run_dir / "checkpoints" / "step_000003").rename(tmp_path / "older")
    damaged = (run_dir / "checkpoints" / "step_000005" / STATE_FILE).read_bytes()
    assert choose_resume(run_dir, None, load=Checkpointer.read, fresh_start=True) is None
    (aside,) = (run_dir / "aside").iterdir()
    assert aside.name.startswith("step_000005-") and aside.name.endswith("-corrupt")
    assert (aside / STATE_FILE).read_bytes() == damaged


def test_an_undamaged_checkpoint_loads_the_state_that_was_saved(
    save_checkpoint: SaveCheckpoint,  # noqa: F811
) -> None:
    step_dir = save_checkpoint(4).path
    saved = torch.load(step_dir / STATE_FILE, weights_only=True, map_location="cpu")
    loaded = load_state(step_dir)
    for name, tensor in saved["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    assert loaded["counters"] == saved["counters"]


def test_a_failed_verification_waits_for_the_read_and_drops_what_it_read() -> None:
    finished = threading.Event()

    def read() -> str:
        time.sleep(0.3)
        finished.set()
        return "state"

    def verify() -> Manifest:
        raise IntegrityError("x: sha256 mismatch (the file is corrupt)")

    with pytest.raises(IntegrityError, match="sha256 mismatch"):
        read_beside_verify(verify, read)
    assert finished.is_set()  # nothing it read is still being filled in after the refusal


def test_what_a_refused_read_produced_is_not_kept_alive_by_the_error() -> None:
    class State:
        pass

    produced: list[weakref.ref[State]] = []

    def read() -> State:
        state = State()
        produced.append(weakref.ref(state))
        return state

    def verify() -> Manifest:
        raise IntegrityError("x: sha256 mismatch (the file is corrupt)")

    try:
        read_beside_verify(verify, read)
    except IntegrityError as exc:
        kept = exc  # the caller holds the error (and its traceback), as a refusal may
    gc.collect()
    assert kept.__traceback__ is not None
    assert produced[0]() is None  # the state the worker read is gone with it
