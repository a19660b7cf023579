"""The `files` format: a trainer's own file or directory held byte for byte, listed, verified
and put back where it came from (runner/checkpoint/formats/files.py), and the adopter that
commits one only when it is whole (runner/supervisor/adopt_files.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from runner.checkpoint.formats import files as files_format
from runner.checkpoint.formats.files import (
    NotAdoptableError,
    list_tree,
    restore,
    step_in_name,
)
from runner.checkpoint.listing import read_manifest_dir
from runner.checkpoint.manifest import FORMAT_FILES
from runner.checkpoint.staging import Staging
from runner.checkpoint.verify import verify_checkpoint
from runner.checkpoint.writer import CheckpointWriter
from runner.storage.file import FileStorage
from runner.supervisor.adopt_files import FilesAdopter


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("checkpoint-500", 500),
        ("epoch=0-step=500.ckpt", 500),
        ("ckpt-000500.pt", 500),
        ("step=7", 7),
        ("last.ckpt", None),
        ("model.safetensors", None),
    ],
)
def test_the_step_is_the_last_integer_in_the_name(name: str, step: int | None) -> None:
    assert step_in_name(name) == step


def _tree(root: Path, name: str = "checkpoint-5") -> Path:
    ckpt = root / "out" / name
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "weights.bin").write_bytes(b"\x01" * 1000)
    (ckpt / "sub" / "state.json").write_text('{"step": 5}')
    return ckpt


def _adopter(tmp_path: Path, *, quiet: float = 0.0, clock=None) -> FilesAdopter:  # type: ignore[no-untyped-def]
    writer = CheckpointWriter(tmp_path / "run" / "checkpoints", run_id="run", writer_id="test")
    kwargs = {} if clock is None else {"clock": clock}
    return FilesAdopter(
        ["out/checkpoint-*"], root=tmp_path, writer=writer, quiet_seconds=quiet, **kwargs
    )


def test_a_directory_is_committed_byte_for_byte_and_verifies(tmp_path: Path) -> None:
    _tree(tmp_path)
    adopted = _adopter(tmp_path).scan(settled=True)
    assert [a.checkpoint.step for a in adopted] == [5]
    step_dir = tmp_path / "run" / "checkpoints" / "step_000005"
    manifest = read_manifest_dir(step_dir)
    assert manifest.format == FORMAT_FILES and manifest.schema == "5"
    assert [f.path for f in manifest.files] == [
        "checkpoint-5/sub/state.json",
        "checkpoint-5/weights.bin",
    ]
    assert manifest.extra["source"] == "out/checkpoint-5"
    assert (step_dir / "checkpoint-5" / "weights.bin").read_bytes() == b"\x01" * 1000
    assert verify_checkpoint(FileStorage(tmp_path / "run"), 5).files == manifest.files
    # the trainer's own files are where they were
    assert (tmp_path / "out" / "checkpoint-5" / "weights.bin").read_bytes() == b"\x01" * 1000


def test_restore_puts_the_tree_back_and_keeps_what_was_in_the_way(tmp_path: Path) -> None:
    ckpt = _tree(tmp_path)
    _adopter(tmp_path).scan(settled=True)
    step_dir = tmp_path / "run" / "checkpoints" / "step_000005"
    manifest = read_manifest_dir(step_dir)
    original = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}

    # in place and identical: left alone
    assert restore(step_dir, manifest, root=tmp_path).copied is False

    # a different tree there (a half-written save): set aside, not deleted; ours put back
    (ckpt / "weights.bin").write_bytes(b"torn")
    restored = restore(step_dir, manifest, root=tmp_path)
    assert restored.copied and restored.aside == tmp_path / "out" / ".checkpoint-5.runner-aside"
    assert (restored.aside / "weights.bin").read_bytes() == b"torn"
    now = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    assert now == original

    # on an empty node: created with its parents
    shutil.rmtree(tmp_path / "out")
    assert restore(step_dir, manifest, root=tmp_path).copied
    now = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    assert now == original
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-5"]


def test_a_tree_with_a_symlink_is_refused_whole(tmp_path: Path) -> None:
    ckpt = _tree(tmp_path)
    os.symlink(ckpt / "weights.bin", ckpt / "link.bin")
    with pytest.raises(NotAdoptableError, match="symlink"):
        list_tree(ckpt)
    adopter = _adopter(tmp_path)
    assert adopter.scan(settled=True) == []
    assert list(adopter.not_adopted) == ["out/checkpoint-5"]
    assert not (tmp_path / "run" / "checkpoints" / "step_000005").exists()


def test_a_written_in_place_tree_waits_for_quiet(tmp_path: Path) -> None:
    now = [100.0]
    adopter = _adopter(tmp_path, quiet=5.0, clock=lambda: now[0])
    ckpt = _tree(tmp_path)
    assert adopter.scan(settled=False) == []  # first sight
    now[0] += 4.0
    (ckpt / "more.bin").write_bytes(b"x")  # still being written
    assert adopter.scan(settled=False) == []
    now[0] += 4.9
    assert adopter.scan(settled=False) == []  # 4.9 s quiet
    now[0] += 0.2
    adopted = adopter.scan(settled=False)
    assert [a.checkpoint.step for a in adopted] == [5]
    assert len(adopted[0].checkpoint.manifest.files) == 3


def test_a_tree_deleted_while_it_is_copied_is_not_committed_fault_injected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's save_total_limit deleting the directory mid-copy (injected: the
    deletion happens inside the copy, where a real trainer's timing cannot be pinned)."""
    ckpt = _tree(tmp_path)
    real_copy = Staging.copy_in
    copied: list[str] = []

    def copy_then_delete(self: Staging, name: str, src: Path):  # type: ignore[no-untyped-def]
        copied.append(name)
        entry = real_copy(self, name, src)
        shutil.rmtree(ckpt, ignore_errors=True)
        return entry

    monkeypatch.setattr(Staging, "copy_in", copy_then_delete)
    adopter = _adopter(tmp_path)
    assert adopter.scan(settled=True) == []
    # the second file was gone when its copy began
    assert copied == ["checkpoint-5/sub/state.json", "checkpoint-5/weights.bin"]
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == []  # nothing committed, no leftover
    assert adopter.not_adopted == {}


def test_a_tree_changed_while_it_is_copied_is_copied_again_fault_injected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _tree(tmp_path)
    real_copy = Staging.copy_in
    changes = [b"\x02" * 1000]

    def copy_then_change(self: Staging, name: str, src: Path):  # type: ignore[no-untyped-def]
        entry = real_copy(self, name, src)
        if changes and name.endswith("state.json"):
            (ckpt / "weights.bin").write_bytes(changes.pop())
        return entry

    monkeypatch.setattr(Staging, "copy_in", copy_then_change)
    adopter = _adopter(tmp_path)
    assert adopter.scan(settled=True) == []  # changed under the copy: not committed
    adopted = adopter.scan(settled=True)  # the next scan copies the tree as it is now
    step_dir = adopted[0].checkpoint.path
    assert (step_dir / "checkpoint-5" / "weights.bin").read_bytes() == b"\x02" * 1000


def test_a_name_without_a_step_is_refused_once_with_how_to_fix_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _tree(tmp_path, name="checkpoint-last")
    adopter = _adopter(tmp_path)
    assert adopter.scan(settled=True) == []
    assert adopter.scan(settled=True) == []
    told = [r.getMessage() for r in caplog.records if "no step in it" in r.getMessage()]
    assert told == [
        "not adopting out/checkpoint-last: its name has no step in it. Put the step into the "
        "checkpoint's name (the last integer in it is taken: checkpoint-500, step=500.ckpt, "
        "ckpt-000500.pt)"
    ]


def test_an_older_or_committed_step_is_not_adopted_again(tmp_path: Path) -> None:
    _tree(tmp_path, name="checkpoint-5")
    adopter = _adopter(tmp_path)
    assert [a.checkpoint.step for a in adopter.scan(settled=True)] == [5]
    assert adopter.scan(settled=True) == []
    _tree(tmp_path, name="checkpoint-3")  # older than step 5: a copy would be pruned at once
    assert adopter.scan(settled=True) == []
    assert files_format.step_in_name("checkpoint-3") == 3
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_000005"]
