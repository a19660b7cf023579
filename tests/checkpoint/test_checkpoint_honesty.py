"""A checkpoint cannot lie about itself: the manifest's step, the directory
name and the counters inside the payload must agree. Real `python -m runner demo` processes
on a run dir, a `file://` mirror and the S3 server."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.atomicity.files import sha256_file
from runner.checkpoint.layout import checkpoint_key
from tests.fixtures.ckpt import SaveCheckpoint
from tests.fixtures.demo_process import logged_steps, run_demo
from tests.fixtures.s3 import SeaweedS3

FORGED = 999_999_999
FORGED_WHY = (
    "step_999999999: the manifest and the payload disagree (step: manifest 999999999, payload 30)"
)


def runner(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def contents(root: Path) -> set[str]:
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def forge(step_dir: Path, step: int) -> Path:
    """A byte copy of a checkpoint under another step's name, its manifest edited to say
    that step: every size and sha256 the manifest lists is still valid."""
    forged = step_dir.with_name(f"step_{step:06d}")
    shutil.copytree(step_dir, forged)
    manifest = json.loads((forged / "manifest.json").read_bytes())
    manifest["step"] = step
    (forged / "manifest.json").write_text(json.dumps(manifest))
    return forged


def mislabel(run: Path, *, holder: int, payload_of: int) -> None:
    """`step_<holder>` made to hold step `payload_of`'s state.pt, its manifest still that of
    `holder` (counters, step) with sizes and sha256 rewritten to match the new file."""
    target = run / checkpoint_key(holder)
    shutil.copyfile(run / checkpoint_key(payload_of) / "state.pt", target / "state.pt")
    manifest = json.loads((target / "manifest.json").read_bytes())
    for entry in manifest["files"]:
        entry["size"], entry["sha256"] = sha256_file(target / entry["path"])
    (target / "manifest.json").write_text(json.dumps(manifest))


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


@pytest.mark.slow
def test_forged_newest_step_is_skipped_and_restarts_never_redo_steps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ok(run_demo(run, steps=30, ckpt_every=10))
    forged = forge(run / checkpoint_key(30), FORGED)
    forged_bytes = contents(forged)

    checked = runner("verify", run, "--step", str(FORGED))
    assert checked.returncode == 3, checked
    assert FORGED_WHY in checked.stdout

    first = _ok(run_demo(run, steps=40, ckpt_every=10))
    assert f"not resuming from step {FORGED}: local: {run}/checkpoints/{FORGED_WHY}" in first
    assert f"resumed from {run / checkpoint_key(30)} (step 30," in first
    assert logged_steps(run) == list(range(1, 41))

    second = _ok(run_demo(run, steps=40, ckpt_every=10))
    # newest by progress: the forgery claims step 30's 480 samples, fewer than step 40's 640,
    # so the walk takes step 40 first and never reads the forgery again
    assert FORGED_WHY not in second
    assert f"resumed from {run / checkpoint_key(40)} (step 40," in second
    assert "redone" not in second
    assert logged_steps(run) == list(range(1, 41))  # every step logged once: none redone
    assert forged_bytes <= contents(run)  # the forgery is refused, not destroyed


@pytest.mark.slow
def test_forged_step_in_a_file_mirror_is_skipped_on_download(tmp_path: Path) -> None:
    """A fresh node (empty run dir) resuming from a file:// mirror whose newest step is a
    forgery: it is downloaded, its counters disagree, it is never published locally, and
    the run resumes from the mirror's honest step 30."""
    mirror = tmp_path / "mirror"
    _ok(run_demo(tmp_path / "old-node", "--mirror", f"file://{mirror}", steps=30, ckpt_every=10))
    forge(mirror / checkpoint_key(30), FORGED)
    mirror_before = {
        p.relative_to(mirror).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in mirror.rglob("*")
        if p.is_file()
    }
    fresh = tmp_path / "new-node"
    out = _ok(run_demo(fresh, "--mirror", f"file://{mirror}", steps=40, ckpt_every=10))
    assert f"not resuming from step {FORGED}: file://{mirror}: " in out
    assert "the manifest and the payload disagree (step: manifest 999999999, payload 30)" in out
    assert f"resumed from {fresh / checkpoint_key(30)} (step 30," in out
    assert not (fresh / checkpoint_key(FORGED)).exists()
    assert not any(p.name.startswith(".tmp-") for p in (fresh / "checkpoints").iterdir())
    assert {k: v for k, v in mirror_before.items() if "step_999999999" in k} == {
        p.relative_to(mirror).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in (mirror / checkpoint_key(FORGED)).rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_step_holding_another_steps_payload_fails_verify(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ok(run_demo(run, steps=30, ckpt_every=10))
    mislabel(run, holder=30, payload_of=20)
    before = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*.*")}
    why = (
        "step_000030: the manifest and the payload disagree (step: manifest 30, payload 20; "
        "samples_seen: manifest 480, payload 320; batch_in_epoch: manifest 30, payload 20)"
    )
    result = runner("verify", run)
    assert result.returncode == 3, result
    assert f"step       30  CORRUPT: {run}/checkpoints/{why}" in result.stdout
    assert "newest that verifies: step 20" in result.stderr
    step = runner("verify", f"file://{run}", "--step", "30", "--json")
    assert step.returncode == 3
    assert [(r["step"], r["ok"]) for r in json.loads(step.stdout)] == [(30, False)]
    assert why in json.loads(step.stdout)[0]["error"]
    status = runner("status", run, "--json")
    assert status.returncode == 0
    (loc,) = json.loads(status.stdout)
    assert loc["newest"]["verified"] is False and why in loc["newest"]["error"]
    assert loc["newest_verified"]["step"] == 20
    after = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*.*")}
    assert after == before


@pytest.mark.slow
@pytest.mark.e2e
def test_lying_checkpoints_in_s3_are_refused_by_verify_and_pull(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    """Through the streamed (non-local) check: the counters of a small state.pt are read
    (bounded, re-hashed) after hashing."""
    env = s3_server.env()
    bucket = s3_server.create_bucket()
    location = f"s3://{bucket}/runs/job"
    run = tmp_path / "run"
    _ok(run_demo(run, steps=30, ckpt_every=10))
    forge(run / checkpoint_key(30), FORGED)
    mislabel(run, holder=20, payload_of=10)
    client = s3_server.client()
    files = sorted(run.joinpath("checkpoints").rglob("*"), key=lambda p: p.name == "manifest.json")
    for path in files:  # manifests last, as an uploader would
        if path.is_file():
            key = f"runs/job/{path.relative_to(run).as_posix()}"
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())

    verified = runner("verify", location, "--json", env=env)
    assert verified.returncode == 3, verified
    rows = {r["step"]: r for r in json.loads(verified.stdout)}
    assert [s for s, r in rows.items() if r["ok"]] == [30, 10]
    assert "(step: manifest 999999999, payload 30)" in rows[FORGED]["error"]
    assert "(step: manifest 20, payload 10;" in rows[20]["error"]

    dest = tmp_path / "dest"
    pulled = runner("pull", location, dest, "--json", env=env)
    assert pulled.returncode == 0, pulled
    assert json.loads(pulled.stdout)["step"] == 30
    refused = runner("pull", location, dest, "--step", "20", env=env)
    assert refused.returncode == 3, refused
    assert "(step: manifest 20, payload 10;" in refused.stderr
    assert sorted(p.name for p in (dest / "checkpoints").iterdir()) == ["step_000030"]


@pytest.mark.slow
def test_hostile_manifests_are_refused_by_the_cli_without_reading_them_whole(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    """A 4 GiB (sparse) manifest and one listing 100001 files: `verify`, `status` and
    `inspect` refuse them with exit 3, quickly and in bounded memory; the good step stays
    the resume point."""
    import time

    save_checkpoint(1)
    huge = save_checkpoint(2)
    many = save_checkpoint(3)
    with open(huge.path / "manifest.json", "r+b") as f:
        f.truncate(4 * 1024**3)
    data = json.loads((many.path / "manifest.json").read_bytes())
    entry = data["files"][0]
    data["files"] = [{**entry, "path": f"f{i:06d}"} for i in range(100_001)]
    (many.path / "manifest.json").write_text(json.dumps(data))
    run = tmp_path / "run"

    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", "verify", str(run), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, wait_status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(wait_status)
    assert time.monotonic() - started < 30
    assert proc.returncode == 3, out
    # this child alone (ru_maxrss in KiB): torch and all, far below the 4 GiB it refused
    assert usage.ru_maxrss < 1024 * 1024
    rows = {r["step"]: r for r in json.loads(out)}
    assert rows[1]["ok"] and not rows[2]["ok"] and not rows[3]["ok"]
    assert "manifest.json: larger than the 16777216 bytes a manifest may have" in rows[2]["error"]
    assert "lists 100001 files, more than the 100000 a checkpoint may have" in rows[3]["error"]
    status = runner("status", run, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)[0]["newest_verified"]["step"] == 1
    inspected = runner("inspect", huge.path)
    assert inspected.returncode == 3 and "more than the 16777216 a manifest may have" in (
        inspected.stderr
    )
