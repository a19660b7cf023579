"""What `make_room` may delete for a save that found the disk full: the oldest usable checkpoint
older than the newest verified one, never that one, never one of a schema this runner cannot
read, one whose objects an aside record names, a step the caller protects, or a corrupt one."""

from __future__ import annotations

import errno
import json
from pathlib import Path

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.room import make_room, out_of_space
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import make_checkpoint


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def _corrupt(run_dir: Path, step: int) -> None:
    path = _step_dir(run_dir, step) / "weights.bin"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def _foreign_schema(run_dir: Path, step: int) -> None:
    path = _step_dir(run_dir, step) / "manifest.json"
    data = json.loads(path.read_text())
    data["schema"] = "99"
    path.write_text(json.dumps(data))


def test_deletes_the_oldest_usable_older_than_the_newest_verified(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for step in (1, 2, 3, 4, 5):
        make_checkpoint(run_dir, step)
    _foreign_schema(run_dir, 1)  # maybe good for another version: never deleted
    _corrupt(run_dir, 2)  # left for `runner repair`
    _corrupt(run_dir, 5)  # the newest verified is 4
    allocated = sum(p.stat().st_blocks * 512 for p in _step_dir(run_dir, 3).iterdir())
    good: set[int] = set()
    room = make_room(FileStorage(run_dir), known_good=good)
    assert room is not None
    assert (room.deleted, room.newest_verified, room.freed_bytes) == (3, 4, allocated)
    assert list_checkpoints(FileStorage(run_dir)) == [1, 2, 4, 5]
    assert good == {4}  # checked once, kept for the next time
    assert make_room(FileStorage(run_dir), known_good=good) is None  # 4 stands alone
    assert list_checkpoints(FileStorage(run_dir)) == [1, 2, 4, 5]


def test_leaves_protected_steps_and_aside_named_objects_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for step in (1, 2, 3, 4):
        make_checkpoint(run_dir, step)
    record = run_dir / "aside" / "step_000001-20261201T000000000000Z-foreign"
    record.mkdir(parents=True)
    (record / "decommitted-manifest.json").write_text(
        json.dumps({"step": 1, "files": [{"path": "weights.bin"}]})
    )
    storage = FileStorage(run_dir)
    room = make_room(storage, protect={2}, known_good={1, 2, 3, 4})
    assert room is not None and (room.deleted, room.newest_verified) == (3, 4)
    assert make_room(storage, protect={2}, known_good={1, 2, 4}) is None
    assert list_checkpoints(storage) == [1, 2, 4]


def test_out_of_space_is_found_behind_a_wrapper_and_nothing_else_counts() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        raise RuntimeError("PytorchStreamWriter failed writing file") from full
    except RuntimeError as wrapped:
        assert out_of_space(wrapped) is full
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert out_of_space(quota) is quota
    assert out_of_space(OSError(errno.EIO, "Input/output error")) is None
    assert out_of_space(ValueError("no")) is None
