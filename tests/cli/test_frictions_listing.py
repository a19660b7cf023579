"""`ls`, `verify` and `status` on a location one or two levels too deep say so and name the
LOCATION to give; `ls --verify` shows a corrupt checkpoint's size and age from its readable
manifest with the verdict. Real subprocesses, a real SeaweedFS for the s3:// case."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.ckpt import SaveCheckpoint
from tests.fixtures.s3 import SeaweedS3


def runner(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _one_level_hint(location: str, up: str) -> str:
    return (
        f"{location} looks like a checkpoints/ directory (it holds step_N directories), one "
        f"level too deep: give {up}, the run dir or mirror holding it"
    )


def _step_dir_hint(location: str, up: str, step: int) -> str:
    return (
        f"{location} is one checkpoint directory (it holds manifest.json), not a run dir or "
        f"mirror: give {up} (`runner verify {up} --step {step}` checks just this one), or "
        f"`runner inspect {location}`"
    )


def test_a_checkpoints_dir_given_as_location_is_named_with_its_run_dir(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(1)
    run = str(tmp_path / "run")
    location = f"{run}/checkpoints"
    hint = _one_level_hint(location, run)

    listed = runner("ls", location)
    assert listed.returncode == 0, listed
    assert listed.stdout == f"no checkpoints at file://{location}\n"
    assert listed.stderr == f"hint: {hint}\n"
    as_json = runner("ls", location, "--json")
    assert json.loads(as_json.stdout) == [] and as_json.stderr == f"hint: {hint}\n"

    verified = runner("verify", location)
    assert verified.returncode == 3, verified
    assert verified.stderr == (
        f"runner: error: file://{location}: no checkpoints to verify\nhint: {hint}\n"
    )

    status = runner("status", location)
    assert status.returncode == 0, status
    assert status.stdout == f"{location}\n  no checkpoints\n  hint      {hint}\n"
    (loc,) = json.loads(runner("status", location, "--json").stdout)
    assert loc["hint"] == hint and loc["steps"] == []

    # the name alone is enough when it holds nothing yet
    (tmp_path / "other/checkpoints").mkdir(parents=True)
    named = runner("ls", tmp_path / "other/checkpoints")
    assert named.stderr == (
        f"hint: {tmp_path}/other/checkpoints looks like a checkpoints/ directory (it is named "
        f"checkpoints), one level too deep: give {tmp_path}/other, the run dir or mirror "
        "holding it\n"
    )


@pytest.mark.slow
def test_a_step_dir_given_as_location_is_named_with_its_run_dir_and_step(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(7)
    run = str(tmp_path / "run")
    location = f"{run}/checkpoints/step_000007"
    hint = _step_dir_hint(location, run, 7)
    verified = runner("verify", location)
    assert verified.returncode == 3
    assert verified.stderr.endswith(f"no checkpoints to verify\nhint: {hint}\n"), verified.stderr
    one = runner("verify", location, "--step", "7")
    assert one.returncode == 3
    assert one.stderr.endswith(f"(newest steps: none)\nhint: {hint}\n"), one.stderr
    assert runner("ls", location).stderr == f"hint: {hint}\n"
    assert f"  hint      {hint}\n" in runner("status", location).stdout
    assert runner("verify", run, "--step", "7").returncode == 0  # the advice works


def test_a_plain_empty_dir_gets_no_hint(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    listed = runner("ls", tmp_path / "empty")
    assert listed.returncode == 0 and listed.stderr == ""
    verified = runner("verify", tmp_path / "empty")
    assert verified.returncode == 3
    assert verified.stderr == f"runner: error: file://{tmp_path}/empty: no checkpoints to verify\n"


@pytest.mark.slow
@pytest.mark.e2e
def test_an_s3_prefix_one_or_two_levels_too_deep_is_named(
    s3_server: SeaweedS3, tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    save_checkpoint(3)
    env = s3_server.env()
    mirror = f"s3://{s3_server.create_bucket()}/runs/job"
    pushed = runner("push", tmp_path / "run", mirror, env=env)
    assert pushed.returncode == 0, pushed
    listed = runner("ls", f"{mirror}/checkpoints", env=env)
    assert listed.returncode == 0, listed
    assert listed.stderr == f"hint: {_one_level_hint(f'{mirror}/checkpoints', mirror)}\n"
    step_dir = f"{mirror}/checkpoints/step_000003"
    verified = runner("verify", step_dir, env=env)
    assert verified.returncode == 3
    assert verified.stderr.endswith(f"hint: {_step_dir_hint(step_dir, mirror, 3)}\n"), verified


@pytest.mark.slow
def test_ls_verify_shows_size_age_and_verdict_of_a_corrupt_checkpoint(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    """The payload fails its sha256 but the manifest reads: the row shows the manifest's size,
    age and format (it showed `?`) and `corrupt: <reason>`; an unreadable schema is not
    called corrupt."""
    for step in (1, 2, 3):
        save_checkpoint(step)
    ckpts = tmp_path / "run/checkpoints"
    payload = ckpts / "step_000002/state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 3] ^= 0x40
    payload.write_bytes(bytes(data))
    manifest = json.loads((ckpts / "step_000002/manifest.json").read_bytes())
    size = sum(f["size"] for f in manifest["files"])
    newer = json.loads((ckpts / "step_000003/manifest.json").read_bytes())
    (ckpts / "step_000003/manifest.json").write_text(json.dumps({**newer, "schema": "99"}))

    rows = json.loads(runner("ls", tmp_path / "run", "--verify", "--json").stdout)
    corrupt = rows[1]
    assert (corrupt["step"], corrupt["verified"], corrupt["verdict"]) == (2, False, "corrupt")
    assert corrupt["size"] == size and corrupt["format"] == "torch-state"
    assert 0 <= corrupt["age_seconds"] < 600
    assert corrupt["fingerprint"] == manifest["fingerprint"]
    assert (rows[0]["verdict"], "size" in rows[0]) == ("unreadable", False)

    lines = runner("ls", tmp_path / "run", "--verify").stdout.splitlines()
    reason = f"{payload}: sha256 mismatch (the file is corrupt)"
    step2 = lines[2].split(None, 5)
    assert step2[0] == "2" and step2[1:3] != ["?", "?"] and step2[3] != "?"
    assert lines[2].endswith(f"torch-state    corrupt: {reason}"), lines
    assert lines[1].split()[:3] == ["3", "?", "?"]
    assert "unreadable: " in lines[1] and "unknown schema version '99'" in lines[1]
    assert lines[3].split()[0] == "1" and lines[3].endswith("torch-state    yes")
    assert len(lines) == 4  # the reason is on the row, not on a line of its own
