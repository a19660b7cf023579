"""The CLI on mirror locations, as a user runs it: `runner` subprocesses configured only
through the standard AWS environment, against the real SeaweedFS server."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from runner.checkpoint.layout import checkpoint_key
from runner.console.progress import transfer_progress
from tests.fixtures.ckpt import make_checkpoint
from tests.fixtures.cli_process import runner
from tests.fixtures.s3 import SeaweedS3


@pytest.mark.slow
@pytest.mark.e2e
def test_push_ls_verify_pull_prune_fork_on_s3(s3_server: SeaweedS3, tmp_path: Path) -> None:
    env = s3_server.env()
    location = f"s3://{s3_server.create_bucket()}/runs/job-1"
    run = tmp_path / "run"
    ckpts = {step: make_checkpoint(run, step) for step in (10, 20, 30)}

    pushed = runner("push", str(run), location, "--json", env=env)
    assert pushed.returncode == 0, pushed.stderr
    assert [c["status"] for c in json.loads(pushed.stdout)["checkpoints"]] == ["pushed"] * 3
    again = runner("push", str(run), location, "--json", env=env)
    assert [c["status"] for c in json.loads(again.stdout)["checkpoints"]] == ["present"] * 3

    listed = runner("ls", location, "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [row["step"] for row in json.loads(listed.stdout)] == [30, 20, 10]
    assert runner("verify", location, env=env).returncode == 0

    # a flipped byte in the newest remote checkpoint
    client = s3_server.client()
    bucket = location.split("/")[2]
    (key,) = [
        o["Key"]
        for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/job-1/")["Contents"]
        if "step_000030/" in o["Key"] and o["Key"].endswith("weights.bin")
    ]
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[100] ^= 0x40
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    verified = runner("verify", location, env=env)
    assert verified.returncode == 3
    assert "step 30" in verified.stderr and "corrupt" in verified.stderr
    assert "newest that verifies: step 20" in verified.stderr

    status = runner("status", location, "--json", env=env)
    assert status.returncode == 0, status.stderr
    (summary,) = json.loads(status.stdout)
    assert summary["newest"]["step"] == 30 and summary["newest"]["verified"] is False
    assert summary["newest_verified"]["step"] == 20

    dest = tmp_path / "pulled"
    pulled = runner("pull", location, str(dest), env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert "step 30: skipped" in pulled.stderr and "sha256" in pulled.stderr
    got = dest / checkpoint_key(20)
    for name in ("manifest.json", "weights.bin", "extra.json"):
        assert (got / name).read_bytes() == (ckpts[20].path / name).read_bytes()
    assert not (dest / checkpoint_key(30)).exists()
    assert runner("pull", location, str(tmp_path / "x"), "--step", "30", env=env).returncode == 3

    forked = runner("fork", location, str(tmp_path / "fork"), "--json", env=env)
    assert forked.returncode == 0, forked.stderr
    fork_info = json.loads(forked.stdout)
    assert fork_info["step"] == 20 and [s["step"] for s in fork_info["skipped"]] == [30]
    fork_dir = tmp_path / "fork" / checkpoint_key(20)
    assert (fork_dir / "weights.bin").read_bytes() == (ckpts[20].path / "weights.bin").read_bytes()
    assert runner("verify", str(tmp_path / "fork"), env=env).returncode == 0

    pruned = runner("prune", location, "--keep", "2", env=env)
    assert pruned.returncode == 0, pruned.stderr
    remaining = runner("ls", location, "--json", env=env)
    # 30 is corrupt: not counted among the 2 kept (20, 10) and not deleted either (a push of
    # a good copy heals it)
    assert [row["step"] for row in json.loads(remaining.stdout)] == [30, 20, 10]


@pytest.mark.e2e
def test_wrong_key_gives_a_clear_error_without_the_secret(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    location = f"s3://{s3_server.create_bucket()}/runs/job-2"
    make_checkpoint(tmp_path / "run", 1)
    env = {**s3_server.env(), "AWS_SECRET_ACCESS_KEY": "wrong-secret-value-123"}
    result = runner("push", str(tmp_path / "run"), location, env=env)
    assert result.returncode == 2  # a configuration error: retrying elsewhere cannot help
    assert location.split("/")[2] in result.stderr and s3_server.endpoint in result.stderr
    assert "refused" in result.stderr
    assert "wrong-secret-value-123" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_push_and_pull_on_file_locations(tmp_path: Path) -> None:
    run = tmp_path / "run"
    ckpt = make_checkpoint(run, 5)
    location = f"file://{tmp_path / 'mirror'}"
    assert runner("push", str(run), location).returncode == 0
    pulled = runner("pull", location, str(tmp_path / "dest"), "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["step"] == 5
    got = tmp_path / "dest" / checkpoint_key(5)
    assert (got / "manifest.json").read_bytes() == (ckpt.path / "manifest.json").read_bytes()


def test_pull_names_a_truncated_remote_file_as_truncated(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_checkpoint(run, 5)
    mirror = tmp_path / "mirror"
    assert runner("push", str(run), f"file://{mirror}").returncode == 0
    payload = max(
        (p for p in mirror.rglob("*") if p.is_file() and p.name != "manifest.json"),
        key=lambda p: p.stat().st_size,
    )
    size = payload.stat().st_size
    payload.write_bytes(payload.read_bytes()[: size // 2])
    pulled = runner("pull", f"file://{mirror}", str(tmp_path / "dest"))
    assert pulled.returncode == 3, pulled.stderr
    assert f"{size // 2} bytes stored, the manifest says {size}" in pulled.stderr, pulled.stderr
    assert "truncated" in pulled.stderr
    assert not (tmp_path / "dest" / checkpoint_key(5)).exists()


def test_push_refuses_a_corrupt_local_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_checkpoint(run, 1)
    bad = make_checkpoint(run, 2)
    (bad.path / "extra.json").write_bytes(b'{"step": 3}')
    result = runner("push", str(run), f"file://{tmp_path / 'mirror'}")
    assert result.returncode == 3
    assert "step 2: not pushed, corrupt" in result.stderr
    assert sorted(p.name for p in (tmp_path / "mirror" / "checkpoints").iterdir()) == [
        "step_000001"
    ]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal_and_only_for_long_transfers() -> None:
    tty, pipe, quick = _Terminal(), io.StringIO(), _Terminal()
    for stream in (tty, pipe):
        with transfer_progress(1000, desc="push step 7", stream=stream, show_after_s=0) as step:
            step(600)
            step(400)
    assert "push step 7" in tty.getvalue() and "0.98k" in tty.getvalue()
    assert pipe.getvalue() == ""
    with transfer_progress(1000, desc="push step 8", stream=quick) as step:  # default delay
        step(1000)
    assert quick.getvalue() == ""
