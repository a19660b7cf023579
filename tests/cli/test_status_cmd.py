"""`runner status`: newest checkpoint per location, its step and age, verified or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from runner.cli.status_cmd import location_status
from runner.errors import EXIT_INTEGRITY, EXIT_OK
from runner.mirror import upload_checkpoint
from runner.storage import open_storage


def runner_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def run_and_mirror(tmp_path, save_checkpoint):
    """A run dir with steps 10 and 20, and a file:// mirror holding step 10 only."""
    run_dir = tmp_path / "run"
    first = save_checkpoint(10, run_dir=run_dir)
    second = save_checkpoint(20, run_dir=run_dir)
    mirror = f"file://{tmp_path / 'bucket'}"
    upload_checkpoint(open_storage(mirror), first.path)
    return run_dir, mirror, first, second


@pytest.mark.slow
def test_json_reports_the_newest_verified_checkpoint_per_location(run_and_mirror):
    run_dir, mirror, first, second = run_and_mirror
    result = runner_cli("status", str(run_dir), mirror, "--json")
    assert result.returncode == EXIT_OK, result.stderr
    local, remote = json.loads(result.stdout)

    assert local["location"] == str(run_dir)
    assert local["steps"] == [10, 20]
    assert local["newest"]["step"] == 20
    assert local["newest"]["verified"] is True
    assert local["newest"]["error"] is None
    assert local["newest"]["size_bytes"] == second.manifest.total_bytes
    assert local["newest"]["fingerprint"] == second.manifest.fingerprint
    assert local["newest"]["created_at"] == second.manifest.created_at
    assert 0 <= local["newest"]["age_seconds"] < 60
    assert local["newest_verified"] == local["newest"]

    assert remote["location"] == mirror
    assert remote["steps"] == [10]
    assert remote["newest"]["step"] == 10
    assert remote["newest"]["verified"] is True
    assert remote["newest"]["fingerprint"] == first.manifest.fingerprint


@pytest.mark.slow
def test_human_output_names_step_age_and_verification(run_and_mirror):
    run_dir, mirror, _, _ = run_and_mirror
    result = runner_cli("status", str(run_dir), mirror)
    assert result.returncode == EXIT_OK, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == str(run_dir)
    assert lines[1].startswith("  newest    step 20 (")
    assert lines[1].endswith("by test-writer)  verified")
    assert lines[2] == "  stored    2 checkpoint(s): steps 10, 20"
    assert lines[3] == mirror
    assert lines[4].startswith("  newest    step 10 (")
    assert lines[4].endswith("  verified")


@pytest.mark.slow
def test_corrupt_newest_shows_the_resume_point(run_and_mirror):
    run_dir, _, _, second = run_and_mirror
    corrupt(second.path / "state.pt")
    result = runner_cli("status", str(run_dir))
    assert result.returncode == EXIT_OK, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "  newest    step 20  CORRUPT"
    assert "state.pt: sha256 mismatch" in lines[2]
    assert lines[3].startswith("  resume    step 10 (")
    assert lines[3].endswith("  verified")

    (status,) = json.loads(runner_cli("status", str(run_dir), "--json").stdout)
    assert status["newest"]["step"] == 20
    assert status["newest"]["verified"] is False
    assert status["newest_verified"]["step"] == 10


def test_nothing_verifies_is_an_integrity_failure(run_and_mirror):
    run_dir, _, first, second = run_and_mirror
    corrupt(first.path / "state.pt")
    corrupt(second.path / "state.pt")
    result = runner_cli("status", str(run_dir))
    assert result.returncode == EXIT_INTEGRITY
    assert "  resume    NONE: no checkpoint verifies" in result.stdout
    assert "no checkpoint verifies at" in result.stderr
    assert "runner verify LOCATION" in result.stderr


def test_no_verify_reads_manifests_only(run_and_mirror):
    run_dir, _, _, second = run_and_mirror
    corrupt(second.path / "state.pt")  # not noticed without hashing
    result = runner_cli("status", str(run_dir), "--no-verify", "--json")
    assert result.returncode == EXIT_OK, result.stderr
    (status,) = json.loads(result.stdout)
    assert status["newest"]["step"] == 20
    assert status["newest"]["verified"] is None
    assert status["newest_verified"] is None


def test_empty_location(tmp_path):
    (tmp_path / "empty").mkdir()  # a missing directory is a usage error (test_cli_validation)
    result = runner_cli("status", str(tmp_path / "empty"))
    assert result.returncode == EXIT_OK, result.stderr
    assert result.stdout == f"{tmp_path / 'empty'}\n  no checkpoints\n"


def test_status_requires_a_location():
    result = runner_cli("status")
    assert result.returncode == 2
    assert "Missing argument 'LOCATION...'" in result.stderr


def test_age_is_measured_from_the_manifest_creation_time(run_and_mirror):
    run_dir, _, _, second = run_and_mirror
    created = datetime.fromisoformat(second.manifest.created_at.replace("Z", "+00:00"))
    status = location_status(str(run_dir), verify=True, now=created.timestamp() + 3720)
    assert status.newest is not None
    assert status.newest.age_seconds == pytest.approx(3720)


@pytest.mark.slow
@pytest.mark.e2e
def test_status_of_an_s3_mirror(run_and_mirror, s3_server):
    run_dir, _, _, second = run_and_mirror
    bucket = s3_server.create_bucket()
    uri = f"s3://{bucket}/runs/demo"
    env = {**os.environ, **s3_server.env()}
    subprocess.run(
        [sys.executable, "-m", "runner", "push", str(run_dir), uri],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    result = subprocess.run(
        [sys.executable, "-m", "runner", "status", uri, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == EXIT_OK, result.stderr
    (status,) = json.loads(result.stdout)
    assert status["steps"] == [10, 20]
    assert status["newest"]["step"] == 20
    assert status["newest"]["verified"] is True
    assert status["newest"]["fingerprint"] == second.manifest.fingerprint
