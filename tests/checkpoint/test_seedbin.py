"""Seed format step_NNNNNN.bin: header checks and the mapping to and from a train state."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.checkpoint.convert import bin_to_run_dir, checkpoint_to_bin
from runner.checkpoint.formats.seedbin import read_header, seed_to_state, write_seed_file
from runner.checkpoint.verify import verify_dir
from runner.errors import ConfigError, IntegrityError
from tests.fixtures.ckpt import SaveCheckpoint, state_fingerprint, tiny_train_state


def _seed_bytes(step: int, weights: list[float], m: list[float], v: list[float]) -> bytes:
    arrays = [np.asarray(x, dtype="<f4").tobytes() for x in (weights, m, v)]
    return struct.pack("<ii", step, len(weights)) + b"".join(arrays)


def test_header_is_read_and_size_checked(tmp_path: Path) -> None:
    path = tmp_path / "step_000007.bin"
    path.write_bytes(_seed_bytes(7, [1, 2, 3], [0, 0, 0], [0, 0, 0]))
    header = read_header(path)
    assert (header.step, header.n_params, header.size) == (7, 3, 8 + 36)


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b"", r"size 40 bytes disagrees with its header \(n_params=3 needs 8 \+ 12\*3 = 44\)"),
        (b"\0\0\0\0\0", r"size 49 bytes disagrees with its header"),
    ],
)
def test_size_that_disagrees_with_header_is_rejected(
    tmp_path: Path, tail: bytes, message: str
) -> None:
    good = _seed_bytes(7, [1, 2, 3], [0, 0, 0], [0, 0, 0])
    path = tmp_path / "step_000007.bin"
    path.write_bytes(good[:-4] + tail if not tail else good + tail)
    with pytest.raises(IntegrityError, match=message):
        read_header(path)


def test_short_header_negative_count_and_misnamed_file_are_rejected(tmp_path: Path) -> None:
    short = tmp_path / "a.bin"
    short.write_bytes(b"\x01\x00\x00")
    with pytest.raises(IntegrityError, match="too short for the 8-byte seed header"):
        read_header(short)
    negative = tmp_path / "b.bin"
    negative.write_bytes(struct.pack("<ii", 1, -1))
    with pytest.raises(IntegrityError, match="negative"):
        read_header(negative)
    misnamed = tmp_path / "step_000008.bin"
    misnamed.write_bytes(_seed_bytes(7, [1.0], [0.0], [0.0]))
    with pytest.raises(IntegrityError, match="file name says step 8, header says step 7"):
        read_header(misnamed)


def test_state_to_seed_layout_is_params_then_m_then_v(tmp_path: Path) -> None:
    state = tiny_train_state(steps=3)
    path = tmp_path / "out.bin"
    size, sha = write_seed_file(state, path)
    raw = path.read_bytes()
    params = [state["model"][n] for n in state["param_names"]]
    n = sum(p.numel() for p in params)
    assert (size, sha) == (len(raw), hashlib.sha256(raw).hexdigest())
    assert len(raw) == 8 + 12 * n
    assert struct.unpack("<ii", raw[:8]) == (3, n)
    floats = np.frombuffer(raw[8:], dtype="<f4")
    opt = state["optimizer"]["state"]
    expected = torch.cat(
        [p.flatten() for p in params]
        + [opt[i]["exp_avg"].flatten() for i in range(len(params))]
        + [opt[i]["exp_avg_sq"].flatten() for i in range(len(params))]
    )
    assert np.array_equal(floats, expected.numpy())


def test_seed_maps_back_onto_a_fresh_model_with_identical_fingerprint(tmp_path: Path) -> None:
    trained = tiny_train_state(seed=1, steps=3)
    path = tmp_path / "step_000003.bin"
    write_seed_file(trained, path)
    fresh = tiny_train_state(seed=2, steps=1)  # same architecture, other values
    restored = seed_to_state(path, like=fresh)
    assert restored["counters"]["step"] == 3
    assert state_fingerprint(restored) == state_fingerprint(trained)
    # the restored state drives a real AdamW
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.load_state_dict(restored["model"])
    optimizer.load_state_dict(restored["optimizer"])
    assert torch.equal(
        optimizer.state[model[0].weight]["exp_avg"], trained["optimizer"]["state"][0]["exp_avg"]
    )


def test_seed_for_another_model_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "step_000003.bin"
    write_seed_file(tiny_train_state(steps=3, width=8), path)
    with pytest.raises(IntegrityError, match="belongs to a different model"):
        seed_to_state(path, like=tiny_train_state(steps=1, width=16))


def test_round_trips_are_byte_identical(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> None:
    ckpt = save_checkpoint(4)
    first = tmp_path / "first.bin"
    assert checkpoint_to_bin(ckpt.path, first) == (4, first.stat().st_size)
    seeded = bin_to_run_dir(first, tmp_path / "seedrun", writer_id="t")
    manifest = verify_dir(seeded.path)
    assert manifest.format == "seed-bin"
    assert [f.path for f in manifest.files] == ["step_000004.bin"]
    assert manifest.fingerprint == hashlib.sha256(first.read_bytes()[8:]).hexdigest()
    second = tmp_path / "second.bin"
    checkpoint_to_bin(tmp_path / "seedrun", second)
    assert second.read_bytes() == first.read_bytes()
    # and nothing is overwritten on a second attempt
    with pytest.raises(ConfigError, match="already exists; nothing was overwritten"):
        checkpoint_to_bin(tmp_path / "seedrun", second)
    with pytest.raises(ConfigError, match="already exists; nothing was overwritten"):
        bin_to_run_dir(first, tmp_path / "seedrun", writer_id="t")
