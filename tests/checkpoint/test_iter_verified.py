"""The one newest-first walk (runner.checkpoint.verify.iter_checked / iter_verified) that
status, pull, repair, fork, convert and `verify` use to find the newest good checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from runner.checkpoint.layout import checkpoint_key
from runner.checkpoint.verify import (
    iter_checked,
    iter_verified,
    newest_verified,
    verify_checkpoint,
)
from runner.errors import IntegrityError, SchemaError
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import make_checkpoint


def _flip_a_byte(run: Path, step: int) -> Path:
    """Corrupt the payload of `step` without changing its size: only hashing notices."""
    path = run / checkpoint_key(step) / "weights.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def _mismatch(path: Path) -> str:
    return f"{path}: sha256 mismatch (the file is corrupt)"


def _run(tmp_path: Path, *steps: int) -> FileStorage:
    run = tmp_path / "run"
    for step in steps:
        make_checkpoint(run, step, size=4096)
    return FileStorage(run)


def test_newest_first_in_numeric_order_and_a_corrupt_one_skipped_with_its_reason(
    tmp_path: Path,
) -> None:
    # step_1000000 sorts before step_999999 as text; 100 after 99 either way
    storage = _run(tmp_path, 99, 100, 999_999, 1_000_000)
    corrupt = _flip_a_byte(storage.root, 1_000_000)
    skipped: list[tuple[int, str]] = []
    verdicts = list(iter_verified(storage, on_skip=lambda s, why: skipped.append((s, why))))
    assert [(v.step, v.ok) for v in verdicts] == [
        (1_000_000, False),
        (999_999, True),
        (100, True),
        (99, True),
    ]
    assert skipped == [(1_000_000, _mismatch(corrupt))]
    bad = verdicts[0]
    assert bad.value is None and bad.error == _mismatch(corrupt)
    assert isinstance(bad.exc, IntegrityError)
    assert [v.value.step for v in verdicts[1:] if v.value is not None] == [999_999, 100, 99]
    assert all(v.exc is None and v.error is None for v in verdicts[1:])


def test_nothing_older_than_the_first_good_one_is_hashed(tmp_path: Path) -> None:
    storage = _run(tmp_path, 1, 2, 3)
    newest = _flip_a_byte(storage.root, 3)
    _flip_a_byte(storage.root, 1)  # would be reported if the walk went past step 2
    skipped: list[tuple[int, str]] = []
    walk = iter_verified(storage, on_skip=lambda s, why: skipped.append((s, why)))
    first_good = next(v for v in walk if v.ok)
    assert first_good.step == 2 and first_good.value is not None
    assert first_good.value.step == 2
    assert skipped == [(3, _mismatch(newest))]
    # the walk resumes where it stopped when asked for more
    assert [(v.step, v.ok) for v in walk] == [(1, False)]
    assert [s for s, _ in skipped] == [3, 1]


def test_manifest_only_walk_reads_manifests_and_hashes_nothing(tmp_path: Path) -> None:
    storage = _run(tmp_path, 2, 3, 4)
    _flip_a_byte(storage.root, 3)  # same size: only a hash would notice
    manifest = storage.root / checkpoint_key(4) / "manifest.json"
    data = json.loads(manifest.read_bytes())
    data["step"] = 5  # a mislabelled manifest: refused without hashing
    manifest.write_text(json.dumps(data))
    skipped: list[tuple[int, str]] = []
    verdicts = list(
        iter_verified(storage, hashing=False, on_skip=lambda s, why: skipped.append((s, why)))
    )
    assert [(v.step, v.ok) for v in verdicts] == [(4, False), (3, True), (2, True)]
    assert skipped == [
        (
            4,
            f"{storage.uri}/{checkpoint_key(4)}/manifest.json: manifest says step 5, its "
            "directory is named step 4; the checkpoint is mislabelled or forged",
        )
    ]
    hashed = list(iter_verified(storage))
    assert [(v.step, v.ok) for v in hashed] == [(4, False), (3, False), (2, True)]


def test_given_steps_are_walked_in_that_order_and_other_errors_propagate(
    tmp_path: Path,
) -> None:
    storage = _run(tmp_path, 5, 6, 7)
    corrupt = _flip_a_byte(storage.root, 6)
    walk = iter_checked(storage, verify_checkpoint, steps=[5, 7])
    assert [(v.step, v.ok) for v in walk] == [(5, True), (7, True)]
    # an IntegrityError is not a SchemaError: not skipped, raised out of the walk
    walk = iter_checked(storage, verify_checkpoint, steps=[7, 6, 5], skip=SchemaError)
    assert next(walk).step == 7
    with pytest.raises(IntegrityError) as raised:
        next(walk)
    assert str(raised.value) == _mismatch(corrupt)
    # skip=() skips nothing (fork with a named step)
    with pytest.raises(IntegrityError):
        list(iter_checked(storage, verify_checkpoint, steps=[6], skip=()))


def test_newest_verified_logs_each_skip_and_returns_none_when_nothing_verifies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = _run(tmp_path, 8, 9)
    corrupt = [_flip_a_byte(storage.root, 9), _flip_a_byte(storage.root, 8)]
    with caplog.at_level(logging.WARNING, logger="runner.checkpoint.verify"):
        assert newest_verified(storage) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping checkpoint step 9 at {storage.uri}: {_mismatch(corrupt[0])}",
        f"skipping checkpoint step 8 at {storage.uri}: {_mismatch(corrupt[1])}",
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert list(iter_verified(FileStorage(empty))) == []
    assert newest_verified(FileStorage(empty)) is None
