"""`runner ls / verify / inspect / convert / fork / prune` as real subprocesses: exit codes,
messages, and that bad inputs never overwrite anything."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.atomicity.files import sha256_file
from tests.fixtures.ckpt import SaveCheckpoint


def runner(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _edit_manifest(step_dir: Path, **changes: object) -> None:
    data = json.loads((step_dir / "manifest.json").read_bytes())
    data.update(changes)
    (step_dir / "manifest.json").write_text(json.dumps(data))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


def _sync_manifest(step_dir: Path) -> None:
    data = json.loads((step_dir / "manifest.json").read_bytes())
    for f in data["files"]:
        f["size"], f["sha256"] = sha256_file(step_dir / f["path"])
    (step_dir / "manifest.json").write_text(json.dumps(data))


@pytest.mark.slow
def test_ls_lists_newest_first_with_size_age_format(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    for step in (1, 2, 10):
        save_checkpoint(step)
    _flip_byte(tmp_path / "run/checkpoints/step_000002/state.pt")
    result = runner("ls", tmp_path / "run", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["step"] for r in rows] == [10, 2, 1]
    assert {r["format"] for r in rows} == {"torch-state"}
    assert all(r["verified"] is None and r["size"] > 0 for r in rows)  # cheap: manifest only
    deep = json.loads(runner("ls", tmp_path / "run", "--json", "--verify").stdout)
    assert [(r["step"], r["verified"]) for r in deep] == [(10, True), (2, False), (1, True)]
    text = runner("ls", tmp_path / "run").stdout.splitlines()
    assert text[0].split() == ["STEP", "SIZE", "AGE", "FORMAT", "VERIFIED"]
    assert text[1].split()[0] == "10" and text[1].split()[4] == "torch-state"  # size is "N.N KiB"


@pytest.mark.slow
def test_verify_names_each_corrupt_checkpoint_and_exits_3_only_for_the_newest(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    for step in (1, 2, 3):
        save_checkpoint(step)
    run = tmp_path / "run"
    assert runner("verify", run).returncode == 0
    _flip_byte(run / "checkpoints/step_000001/state.pt")
    older = runner("verify", run)
    assert older.returncode == 0
    assert "step        1  CORRUPT:" in older.stdout and "sha256 mismatch" in older.stdout
    _flip_byte(run / "checkpoints/step_000003/state.pt")
    newest = runner("verify", run, "--json")
    assert newest.returncode == 3
    assert [(r["step"], r["ok"]) for r in json.loads(newest.stdout)] == [
        (3, False),
        (2, True),
        (1, False),
    ]
    assert "step 3 at file://" in newest.stderr and "newest that verifies: step 2" in newest.stderr
    assert runner("verify", run, "--step", "2").returncode == 0
    assert runner("verify", run, "--step", "3").returncode == 3
    mistyped = runner("verify", tmp_path / "no-such-dir")
    assert mistyped.returncode == 2 and "no such directory" in mistyped.stderr
    (tmp_path / "nothing").mkdir()
    empty = runner("verify", tmp_path / "nothing")
    assert empty.returncode == 3 and "no checkpoints to verify" in empty.stderr


CORRUPTIONS = {
    "truncated payload": (
        lambda d: (d / "state.pt").write_bytes((d / "state.pt").read_bytes()[:-100]),
        r"size \d+ != \d+ in the manifest \(truncated or replaced\)",
    ),
    "one flipped byte": (lambda d: _flip_byte(d / "state.pt"), "sha256 mismatch"),
    "path ../x": (
        lambda d: _edit_manifest(d, files=[{"path": "../x", "size": 1, "sha256": "0" * 64}]),
        "'../x' escapes",
    ),
    "path /etc/passwd": (
        lambda d: _edit_manifest(d, files=[{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}]),
        "'/etc/passwd' is absolute",
    ),
    "missing file": (
        lambda d: (d / "state.pt").unlink(),
        "state.pt: listed in the manifest but missing",
    ),
    "unknown manifest schema": (
        lambda d: _edit_manifest(d, schema="7"),
        "unknown schema version '7'",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_verify_refuses_bad_checkpoints_with_a_clear_message(
    tmp_path: Path, save_checkpoint: SaveCheckpoint, case: str
) -> None:
    import re

    ckpt = save_checkpoint(2)
    corrupt, message = CORRUPTIONS[case]
    corrupt(ckpt.path)
    before = snapshot(tmp_path)
    result = runner("verify", tmp_path / "run", "--step", "2")
    assert result.returncode == 3, result
    assert re.search(message, result.stdout), result.stdout
    assert "runner: error: step 2" in result.stderr
    assert snapshot(tmp_path) == before


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["pickle that runs code", "unknown payload schema"])
def test_loading_refuses_payloads_that_verify_but_are_unsafe_or_unknown(
    tmp_path: Path, save_checkpoint: SaveCheckpoint, case: str
) -> None:
    ckpt = save_checkpoint(2)
    marker = tmp_path / "code-ran"
    if case == "pickle that runs code":
        torch.save({"schema": "2", "model": _RunsCode(marker)}, ckpt.path / "state.pt")
        message = "weights-only loading refuses"
    else:
        torch.save({"schema": "3", "model": {}}, ckpt.path / "state.pt")
        message = "unknown payload schema '3'"
    _sync_manifest(ckpt.path)  # the forger controls the manifest too: hashes match
    out = tmp_path / "out.bin"
    before = snapshot(tmp_path)
    result = runner("convert", ckpt.path, out)
    assert result.returncode == 3, result
    assert message in result.stderr
    assert not out.exists() and not marker.exists()
    assert snapshot(tmp_path) == before


def test_seed_bin_with_wrong_size_is_refused_everywhere(tmp_path: Path) -> None:
    bad = tmp_path / "step_000005.bin"
    bad.write_bytes(struct.pack("<ii", 5, 4) + b"\0" * (12 * 4 - 1))
    inspected = runner("inspect", bad)
    assert inspected.returncode == 3
    assert "size 55 bytes disagrees with its header (n_params=4 needs" in inspected.stderr
    converted = runner("convert", bad, tmp_path / "run")
    assert converted.returncode == 3 and "disagrees with its header" in converted.stderr
    assert not (tmp_path / "run").exists()


def test_inspect_shows_manifest_and_seed_header(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    ckpt = save_checkpoint(3)
    info = json.loads(runner("inspect", ckpt.path, "--json").stdout)
    assert (info["kind"], info["step"], info["format"]) == ("manifest", 3, "torch-state")
    assert info["files"][0]["path"] == "state.pt"
    seed = tmp_path / "step_000009.bin"
    seed.write_bytes(struct.pack("<ii", 9, 2) + b"\0" * 24)
    header = json.loads(runner("inspect", seed, "--json").stdout)
    assert header == {
        "kind": "seed-bin",
        "path": str(seed),
        "step": 9,
        "n_params": 2,
        "size": 32,
        "expected_size": 32,
    }
    assert "step: 9" in runner("inspect", seed).stdout


@pytest.mark.slow
def test_convert_round_trip_is_byte_identical(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(4)
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    assert runner("convert", tmp_path / "run", first).returncode == 0
    added = runner("convert", first, tmp_path / "seedrun", "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["dst"] == str(tmp_path / "seedrun/checkpoints/step_000004")
    assert runner("verify", tmp_path / "seedrun").returncode == 0
    assert runner("convert", tmp_path / "seedrun/checkpoints/step_000004", second).returncode == 0
    assert second.read_bytes() == first.read_bytes()
    again = runner("convert", tmp_path / "seedrun", second)
    assert again.returncode == 2 and "nothing was overwritten" in again.stderr


def test_fork_copies_checkpoint_and_loss_history_up_to_the_step(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    for step in (2, 4, 6):
        save_checkpoint(step)
    src = tmp_path / "run"
    lines = [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 3.0},
        {"step": 4, "loss": 4.0},
        {"resume_from": 2},  # a resume from step 2 supersedes steps 3 and 4 above
        {"step": 3, "loss": 30.0},
        {"step": 4, "loss": 40.0},
        {"step": 4, "loss": 41.0},  # last line per step wins
        {"step": 5, "loss": 50.0},
    ]
    (src / "loss.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    dst = tmp_path / "fork"
    result = runner("fork", src, dst, "--step", "4", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    src_manifest = json.loads((src / "checkpoints/step_000004/manifest.json").read_bytes())
    dst_manifest = json.loads((dst / "checkpoints/step_000004/manifest.json").read_bytes())
    assert info["run_id"] == dst_manifest["run_id"] != src_manifest["run_id"]
    assert dst_manifest["fingerprint"] == src_manifest["fingerprint"] == info["fingerprint"]
    assert dst_manifest["files"] == src_manifest["files"]
    assert dst_manifest["extra"]["forked_from"]["step"] == 4
    assert [p.name for p in (dst / "checkpoints").iterdir()] == ["step_000004"]
    forked = [json.loads(line) for line in (dst / "loss.jsonl").read_text().splitlines()]
    assert [(x["step"], x["loss"]) for x in forked] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 41.0)]
    again = runner("fork", src, dst)
    assert again.returncode == 2 and "already holds a run" in again.stderr


@pytest.mark.slow
def test_fork_without_step_skips_a_corrupt_newest(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(1)
    save_checkpoint(2)
    _flip_byte(tmp_path / "run/checkpoints/step_000002/state.pt")
    result = runner("fork", f"file://{tmp_path / 'run'}", tmp_path / "fork", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["step"] == 1 and info["skipped"][0]["step"] == 2
    assert "sha256" in info["skipped"][0]["error"]
    assert not list((tmp_path / "fork/checkpoints").glob(".tmp-*"))


@pytest.mark.slow
def test_prune_keeps_k_usable_and_never_counts_a_corrupt_one(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(step)
    run = tmp_path / "run"
    for step in (4, 5):
        _flip_byte(run / f"checkpoints/step_{step:06d}/state.pt")
    refused = runner("prune", run, "--keep", "1")
    assert refused.returncode == 2 and "--keep must be >= 2" in refused.stderr
    result = runner("prune", run, "--keep", "2", "--json")
    assert result.returncode == 0, result.stderr
    # 5 and 4 are corrupt: not counted among the 2 kept (3 and 2), and not deleted either
    assert json.loads(result.stdout) == {
        "deleted": [1],
        "orphans_deleted": [],
        "orphan_bytes": 0,
        "aside_kept": [],
        "aside_kept_bytes": 0,
    }
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_000002",
        "step_000003",
        "step_000004",
        "step_000005",
    ]
    digest = hashlib.sha256((run / "checkpoints/step_000003/state.pt").read_bytes()).hexdigest()
    manifest = json.loads((run / "checkpoints/step_000003/manifest.json").read_bytes())
    assert manifest["files"][0]["sha256"] == digest
