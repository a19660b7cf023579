"""`runner verify / inspect / ls` on a torch-dcp checkpoint two real ranks wrote: the world
size and each rank's files shown; a corrupt file named with the rank that wrote it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.atomicity.files import atomic_write_bytes, sha256_file
from runner.checkpoint.formats.dcp import TRAIN_STATE_FILE, rank_file_name
from runner.checkpoint.layout import MANIFEST_NAME
from runner.checkpoint.manifest import FORMAT_DCP, FileEntry, Manifest, schema_for
from tests.fixtures.dcp_ranks import save_worker, saved_entries, spawn_ranks

STEP = 2


def runner(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def dcp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir whose one checkpoint is torch-dcp from 2 ranks: DCP's files from save_dcp,
    rank 0's train state and each rank's file, the manifest listing them all."""
    root = tmp_path_factory.mktemp("dcp")
    step_dir = root / "run" / "checkpoints" / f"step_{STEP:06d}"
    step_dir.mkdir(parents=True)
    spawn_ranks(save_worker, 2, step_dir, root / "out", seed=11)
    files = saved_entries(root / "out", 0) + saved_entries(root / "out", 1)
    for name, payload in [
        (TRAIN_STATE_FILE, {"step": STEP}),
        (rank_file_name(0), {"rank": 0}),
        (rank_file_name(1), {"rank": 1}),
    ]:
        torch.save(payload, step_dir / name)
        size, sha256 = sha256_file(step_dir / name)
        files.append(FileEntry(path=name, size=size, sha256=sha256))
    manifest = Manifest(
        schema=schema_for(FORMAT_DCP),
        step=STEP,
        samples_seen=STEP * 2 * 4,
        world_size=2,
        run_id="dcp-test",
        writer="test",
        format=FORMAT_DCP,
        fingerprint="0" * 64,
        files=sorted(files, key=lambda f: f.path),
    )
    atomic_write_bytes(step_dir / MANIFEST_NAME, manifest.to_json())
    return root / "run"


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.slow
def test_verify_passes_then_names_the_corrupt_file_and_its_rank(
    dcp_run: Path, tmp_path: Path
) -> None:
    ok = runner("verify", dcp_run)
    assert (ok.returncode, ok.stdout) == (0, f"step {STEP:>8}  ok\n"), ok.stderr

    run = _copy(dcp_run, tmp_path)
    step_dir = run / "checkpoints" / f"step_{STEP:06d}"
    data = bytearray((step_dir / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (step_dir / "__1_0.distcp").write_bytes(bytes(data))

    bad = runner("verify", run)
    assert bad.returncode == 3, bad.stderr
    assert bad.stdout == (
        f"step {STEP:>8}  CORRUPT: {step_dir}/__1_0.distcp (written by rank 1): sha256 "
        "mismatch (the file is corrupt)\n"
    )
    assert bad.stderr == f"runner: error: step {STEP} at file://{run} is corrupt\n"


@pytest.mark.slow
def test_a_missing_file_is_named_with_its_rank(dcp_run: Path, tmp_path: Path) -> None:
    run = _copy(dcp_run, tmp_path)
    step_dir = run / "checkpoints" / f"step_{STEP:06d}"
    (step_dir / ".metadata").unlink()
    result = runner("verify", run, "--json")
    assert result.returncode == 3
    [status] = json.loads(result.stdout)
    assert status["error"] == (
        f"{step_dir}/.metadata (written by rank 0): listed in the manifest but missing"
    )


def test_inspect_shows_world_size_and_each_ranks_files(dcp_run: Path) -> None:
    step_dir = dcp_run / "checkpoints" / f"step_{STEP:06d}"
    listed = json.loads((step_dir / MANIFEST_NAME).read_bytes())["files"]

    def total(*names: str) -> int:
        return sum(f["size"] for f in listed if f["path"] in names)

    info = json.loads(runner("inspect", step_dir, "--json").stdout)
    assert (info["format"], info["schema"], info["world_size"]) == (FORMAT_DCP, "4", 2)
    rank0 = (".metadata", "__0_0.distcp", TRAIN_STATE_FILE, rank_file_name(0))
    assert info["ranks"] == [
        {"rank": 0, "files": 4, "bytes": total(*rank0)},
        {"rank": 1, "files": 2, "bytes": total("__1_0.distcp", rank_file_name(1))},
    ]

    text = runner("inspect", step_dir).stdout.splitlines()
    assert "world_size: 2" in text
    table = text[text.index("ranks:") + 1 :]
    assert [line.split() for line in table] == [
        ["RANK", "FILES", "BYTES"],
        ["0", "4", str(total(*rank0))],
        ["1", "2", str(total("__1_0.distcp", rank_file_name(1)))],
    ]


@pytest.mark.slow
def test_ls_gains_the_world_size_and_keeps_its_columns(dcp_run: Path) -> None:
    [row] = json.loads(runner("ls", dcp_run, "--json").stdout)
    assert (row["step"], row["format"], row["world_size"]) == (STEP, FORMAT_DCP, 2)
    [deep] = json.loads(runner("ls", dcp_run, "--json", "--verify").stdout)
    assert (deep["verified"], deep["world_size"]) == (True, 2)

    text = runner("ls", dcp_run).stdout.splitlines()
    assert text[0].split() == ["STEP", "SIZE", "AGE", "FORMAT", "VERIFIED"]
    assert text[1].split()[0] == str(STEP) and text[1].split()[4] == FORMAT_DCP
    assert text[2].split() == ["world", "size", "2"]
    assert len(text) == 3


def test_commands_that_load_a_train_state_refuse_torch_dcp_without_a_traceback(
    dcp_run: Path, tmp_path: Path
) -> None:
    step_dir = dcp_run / "checkpoints" / f"step_{STEP:06d}"
    result = runner("convert", step_dir, tmp_path / "x.bin")
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "torch-dcp checkpoint (written by 2 ranks)" in result.stderr
    assert "this command does not read torch-dcp yet" in result.stderr
    assert not (tmp_path / "x.bin").exists()
