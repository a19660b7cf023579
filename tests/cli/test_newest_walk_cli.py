"""What pull, fork and repair say on corrupt checkpoints, word for word: the commands that walk
a location newest first (runner.checkpoint.verify.iter_checked), as a user runs them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from runner.checkpoint.layout import checkpoint_key
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.cli_process import runner

_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")


def _said(stderr: str) -> list[str]:
    """The lines the command itself wrote to stderr (log records left out)."""
    return [line for line in stderr.splitlines() if line and not _LOG_LINE.match(line)]


def _flip_a_byte(run: Path, step: int) -> None:
    path = run / checkpoint_key(step) / "weights.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    """A run dir with steps 1, 2, 3 of which 3 and 2 are corrupt."""
    run = tmp_path / "src"
    for step in (1, 2, 3):
        make_checkpoint(run, step, size=4096)
    _flip_a_byte(run, 3)
    _flip_a_byte(run, 2)
    return run


def _pull_skip(src: Path, step: int) -> str:
    return (
        f"file://{src}/{checkpoint_key(step)}/weights.bin: sha256 differs from the manifest "
        "(the stored copy is corrupt)"
    )


def test_pull_reports_each_corrupt_newer_one_and_takes_the_newest_that_verifies(
    src: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "dest"
    pulled = runner("pull", str(src), str(dest))
    assert pulled.returncode == 0, pulled.stderr
    assert _said(pulled.stderr) == [
        f"step 3: skipped, {_pull_skip(src, 3)}",
        f"step 2: skipped, {_pull_skip(src, 2)}",
    ]
    assert pulled.stdout == (
        f"pulled step 1 from file://{src} into {dest / checkpoint_key(1)} (4107 bytes)\n"
    )
    as_json = runner("pull", str(src), str(tmp_path / "dest2"), "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert _said(as_json.stderr) == []
    assert json.loads(as_json.stdout) == {
        "step": 1,
        "path": str(tmp_path / "dest2" / checkpoint_key(1)),
        "skipped": [
            {"step": 3, "error": _pull_skip(src, 3)},
            {"step": 2, "error": _pull_skip(src, 2)},
        ],
    }


def test_pull_exits_3_naming_every_step_tried_when_none_verifies(src: Path, tmp_path: Path) -> None:
    named = runner("pull", str(src), str(tmp_path / "d1"), "--step", "2")
    assert named.returncode == 3
    assert _said(named.stderr) == [
        f"step 2: skipped, {_pull_skip(src, 2)}",
        f"runner: error: no checkpoint at file://{src} verified (tried steps 2)",
    ]
    _flip_a_byte(src, 1)
    none = runner("pull", str(src), str(tmp_path / "d2"))
    assert none.returncode == 3 and none.stdout == ""
    assert _said(none.stderr) == [
        *(f"step {s}: skipped, {_pull_skip(src, s)}" for s in (3, 2, 1)),
        f"runner: error: no checkpoint at file://{src} verified (tried steps 3, 2, 1)",
    ]
    assert not (tmp_path / "d2" / "checkpoints" / checkpoint_key(1)).exists()


def test_fork_skips_corrupt_newer_ones_but_not_a_named_step(src: Path, tmp_path: Path) -> None:
    why = (
        "weights.bin: size or sha256 differs from the source manifest (the source checkpoint "
        "is corrupt)"
    )
    forked = runner("fork", str(src), str(tmp_path / "f1"), "--json")
    assert forked.returncode == 0, forked.stderr
    info = json.loads(forked.stdout)
    assert info["step"] == 1
    assert info["skipped"] == [{"error": why, "step": 3}, {"error": why, "step": 2}]
    logged = [line.split(" ", 2)[2] for line in forked.stderr.splitlines() if "WARNING" in line]
    assert logged == [
        f"WARNING runner.mirror.fork: fork: skipping step {s} of file://{src}: {why}"
        for s in (3, 2)
    ]
    named = runner("fork", str(src), str(tmp_path / "f2"), "--step", "3")
    assert named.returncode == 3
    assert _said(named.stderr) == [f"runner: error: {why}"]


def test_repair_sets_a_corrupt_one_aside_and_leaves_an_unreadable_one_alone(
    src: Path,
) -> None:
    manifest = src / checkpoint_key(2) / "manifest.json"
    data = json.loads(manifest.read_bytes())
    data["schema"] = "99"
    manifest.write_text(json.dumps(data))
    unreadable = (
        f"{manifest}: unknown schema version '99' (this runner reads 1, 2, 3, 4, 5); a newer "
        "spot-runner wrote it: upgrade to read it"
    )
    repaired = runner("repair", str(src), "--json")
    assert repaired.returncode == 3
    assert json.loads(repaired.stdout) == {
        "location": f"file://{src}",
        "checkpoints": [
            {
                "step": 3,
                "status": "set aside",
                "error": f"{src / checkpoint_key(3)}/weights.bin: sha256 mismatch (the file is "
                "corrupt)",
            },
            {"step": 2, "status": "unreadable, left alone", "error": unreadable},
        ],
    }
    assert _said(repaired.stderr) == [
        f"runner: error: step(s) 3 of file://{src} were corrupt and are set aside (kept under "
        "aside/, no longer resumed from); give --from RUN_DIR_OR_MIRROR with good copies to "
        "restore them. The next save of those steps can now land"
    ]
    assert sorted(p.name for p in (src / "checkpoints").iterdir() if p.is_dir()) == [
        "step_000001",
        "step_000002",
    ]
    again = runner("repair", str(src))
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"step 2: unreadable, left alone ({unreadable})\n"
