"""What a download does when the run dir already has a directory for that step: the publish
policy of runner.mirror.download on top of runner.atomicity.publish. Only a copy that fails
verification is replaced, and it is set aside, never deleted; one that verifies stays."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.checkpoint.verify import verify_dir
from runner.errors import CheckpointConflictError
from runner.mirror import download_checkpoint, upload_checkpoint
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import make_checkpoint, tree_hashes


@pytest.fixture
def mirror(tmp_path: Path) -> FileStorage:
    storage = FileStorage(tmp_path / "mirror")
    upload_checkpoint(storage, make_checkpoint(tmp_path / "source", 5).path)
    return storage


def _entries(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir())


def test_a_corrupt_local_copy_is_set_aside_and_replaced(
    mirror: FileStorage, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    local = make_checkpoint(run, 5).path
    weights = bytearray((local / "weights.bin").read_bytes())
    weights[100] ^= 0x01
    (local / "weights.bin").write_bytes(bytes(weights))
    corrupt = tree_hashes(local)

    step_dir = download_checkpoint(mirror, 5, run)

    assert step_dir == local
    assert verify_dir(step_dir).step == 5
    (aside,) = (run / "aside").iterdir()
    assert aside.name.startswith("step_000005-") and aside.name.endswith("-corrupt")
    assert tree_hashes(aside) == corrupt
    assert _entries(run / "checkpoints") == ["step_000005"]


def test_a_local_copy_that_verifies_with_other_contents_stays(
    mirror: FileStorage, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    local = make_checkpoint(run, 5, seed=1).path
    before = tree_hashes(run / "checkpoints")

    with pytest.raises(CheckpointConflictError, match="already holds a different checkpoint"):
        download_checkpoint(mirror, 5, run)

    assert tree_hashes(run / "checkpoints") == before
    assert _entries(run / "checkpoints") == ["step_000005"]
    assert not (run / "aside").exists()
    assert verify_dir(local).step == 5


def test_the_same_checkpoint_already_there_is_left_as_it_is(
    mirror: FileStorage, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    local = make_checkpoint(run, 5).path
    before = tree_hashes(local)
    assert download_checkpoint(mirror, 5, run) == local
    assert tree_hashes(local) == before
    assert _entries(run / "checkpoints") == ["step_000005"]
