"""One verification rule everywhere: no file of a checkpoint may be a
symlink, and no command follows one. Real `python -m runner ...` processes; every file of the
run dir, the mirror and the outside secret is hashed before and after each command to prove
nothing was changed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.atomicity.files import sha256_file
from runner.checkpoint.layout import checkpoint_key
from runner.errors import IntegrityError
from runner.runtime.runlock import LOCK_FILE
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import SaveCheckpoint
from tests.fixtures.demo_process import logged_steps, run_demo

SECRET = b"an outside file a checkpoint must never make a command read\n"


def runner(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def hashes(*roots: Path) -> dict[str, str]:
    """sha256 of every file (a symlink as its target string: never followed) under roots."""
    out: dict[str, str] = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_symlink():
                out[str(p)] = "link->" + os.readlink(p)
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _sync_manifest(step_dir: Path) -> None:
    """The forger controls the manifest: sizes and sha256 made to match (following links)."""
    data = json.loads((step_dir / "manifest.json").read_bytes())
    for f in data["files"]:
        f["size"], f["sha256"] = sha256_file(step_dir / f["path"])
    (step_dir / "manifest.json").write_text(json.dumps(data))


def _link_payload_outside(step_dir: Path, outside: Path) -> None:
    """state.pt becomes a symlink to an identical copy outside the location: every hash in
    the manifest still matches."""
    payload = step_dir / "state.pt"
    outside.write_bytes(payload.read_bytes())
    payload.unlink()
    payload.symlink_to(outside)


@pytest.fixture
def linked_run(tmp_path: Path, save_checkpoint: SaveCheckpoint) -> Path:
    """Run dir with step 1 (good) and step 2 whose state.pt links outside it."""
    save_checkpoint(1)
    bad = save_checkpoint(2)
    _link_payload_outside(bad.path, tmp_path / "outside.pt")
    return tmp_path / "run"


LINK_OUTSIDE = (
    "step_000002/state.pt: is a symlink (resolves outside the checkpoint directory); "
    "refusing to follow it"
)


@pytest.mark.slow
def test_verify_status_ls_refuse_a_payload_symlinked_outside(
    tmp_path: Path, linked_run: Path
) -> None:
    before = hashes(tmp_path)

    verified = runner("verify", linked_run, "--json")
    assert verified.returncode == 3, verified
    rows = json.loads(verified.stdout)
    assert [(r["step"], r["ok"]) for r in rows] == [(2, False), (1, True)]
    assert LINK_OUTSIDE in rows[0]["error"]
    assert (
        "step 2 at file://" in verified.stderr and "newest that verifies: step 1" in verified.stderr
    )
    only = runner("verify", f"file://{linked_run}", "--step", "2")
    assert only.returncode == 3 and LINK_OUTSIDE in only.stdout

    status = runner("status", linked_run, "--json")
    assert status.returncode == 0, status  # a restart resumes from step 1: not exit 3
    (loc,) = json.loads(status.stdout)
    assert loc["newest"]["step"] == 2 and loc["newest"]["verified"] is False
    assert LINK_OUTSIDE in loc["newest"]["error"]
    assert loc["newest_verified"]["step"] == 1

    listed = runner("ls", linked_run, "--verify", "--json")
    assert listed.returncode == 0, listed
    rows = json.loads(listed.stdout)
    assert [(r["step"], r["verified"]) for r in rows] == [(2, False), (1, True)]
    assert LINK_OUTSIDE in rows[0]["error"]

    assert hashes(tmp_path) == before


def test_status_exits_3_when_the_only_checkpoint_is_symlinked(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    only = save_checkpoint(3)
    _link_payload_outside(only.path, tmp_path / "outside.pt")
    before = hashes(tmp_path)
    status = runner("status", tmp_path / "run")
    assert status.returncode == 3, status
    assert "step_000003/state.pt: is a symlink" in status.stdout
    assert "no checkpoint verifies at file://" in status.stderr
    assert runner("verify", tmp_path / "run").returncode == 3
    assert hashes(tmp_path) == before


def test_a_symlink_pointing_inside_the_directory_is_refused_too(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    ckpt = save_checkpoint(4)
    payload = ckpt.path / "state.pt"
    payload.rename(ckpt.path / "real.pt")
    payload.symlink_to("real.pt")  # same bytes, hashes match: writers still never do this
    before = hashes(tmp_path)
    result = runner("verify", tmp_path / "run", "--step", "4")
    assert result.returncode == 3, result
    assert (
        "step_000004/state.pt: is a symlink (points inside the checkpoint directory); "
        "refusing to follow it" in result.stdout
    )
    assert hashes(tmp_path) == before


@pytest.mark.slow
def test_pull_from_file_location_never_follows_a_symlink_out(
    tmp_path: Path, save_checkpoint: SaveCheckpoint
) -> None:
    """A file:// location whose step-2 payload is a symlink to a secret outside it (the
    manifest lists the secret's size and sha256): pull refuses it, copies nothing of the
    secret into DEST, and falls back to step 1."""
    save_checkpoint(1)
    bad = save_checkpoint(2)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(SECRET)
    (bad.path / "state.pt").unlink()
    (bad.path / "state.pt").symlink_to(secret)
    _sync_manifest(bad.path)
    location = f"file://{tmp_path / 'run'}"
    dest = tmp_path / "dest"
    before = hashes(tmp_path)

    step2 = runner("pull", location, dest, "--step", "2")
    assert step2.returncode == 3, step2
    assert f"{location}/checkpoints/step_000002/state.pt is a symlink; refusing to follow it" in (
        step2.stderr
    )
    assert not dest.exists() or not any(
        p.is_file() and p.name != LOCK_FILE for p in dest.rglob("*")
    )  # the lock of the run dir pull writes into is no copied file

    newest = runner("pull", location, dest, "--json")
    assert newest.returncode == 0, newest
    assert json.loads(newest.stdout)["step"] == 1
    assert "step 2: skipped" not in newest.stdout
    copied = {
        p.relative_to(dest).as_posix()
        for p in dest.rglob("*")
        if p.is_file() and p.name != LOCK_FILE
    }
    assert copied == {"checkpoints/step_000001/manifest.json", "checkpoints/step_000001/state.pt"}
    assert all(SECRET not in p.read_bytes() for p in dest.rglob("*") if p.is_file())

    after = hashes(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith(str(dest))} == before


@pytest.mark.slow
def test_push_refuses_a_symlinked_payload_and_sends_nothing_of_it(
    tmp_path: Path, linked_run: Path
) -> None:
    mirror = tmp_path / "mirror"
    before = hashes(linked_run, tmp_path / "outside.pt")
    result = runner("push", linked_run, f"file://{mirror}")
    assert result.returncode == 3, result
    assert (
        f"step 2: not pushed, corrupt locally: {linked_run}/checkpoints/{LINK_OUTSIDE}"
        in result.stderr
    )
    assert sorted(p.name for p in (mirror / "checkpoints").iterdir()) == ["step_000001"]
    assert hashes(linked_run, tmp_path / "outside.pt") == before


def test_file_storage_reads_never_follow_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "loc"
    (root / "checkpoints" / "step_000001").mkdir(parents=True)
    (tmp_path / "secret").write_bytes(SECRET)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "state.pt").write_bytes(SECRET)
    (root / "checkpoints" / "step_000001" / "state.pt").symlink_to(tmp_path / "secret")
    (root / "checkpoints" / "step_000002").symlink_to(tmp_path / "elsewhere")
    storage = FileStorage(root)
    refused = "is a symlink; refusing to follow it"
    for key in ("checkpoints/step_000001/state.pt", "checkpoints/step_000002/state.pt"):
        with pytest.raises(IntegrityError, match=refused):
            storage.open_read(key)
        with pytest.raises(IntegrityError, match=refused):
            storage.head(key)
        with pytest.raises(IntegrityError, match=refused):
            storage.get_file(key, tmp_path / "copy")
        with pytest.raises(IntegrityError, match=refused):
            storage.get_bytes(key)
    assert not (tmp_path / "copy").exists()
    with pytest.raises(IntegrityError, match=refused):
        storage.put_bytes("checkpoints/step_000002/new.txt", b"x")
    assert not (tmp_path / "elsewhere" / "new.txt").exists()
    with pytest.raises(IntegrityError, match=refused):
        storage.delete("checkpoints/step_000002/state.pt")
    assert (tmp_path / "elsewhere" / "state.pt").read_bytes() == SECRET
    # listed as the link itself (lstat), never descending into a linked directory
    listed = {i.key: i.size for i in storage.list("checkpoints/")}
    assert listed == {"checkpoints/step_000001/state.pt": len(str(tmp_path / "secret"))}
    with pytest.raises(IntegrityError, match=refused):
        list(storage.list("checkpoints/step_000002/"))
    os.mkfifo(root / "checkpoints" / "step_000001" / "fifo")
    with pytest.raises(IntegrityError, match="is not a regular file"):
        storage.open_read("checkpoints/step_000001/fifo")  # and does not block


@pytest.mark.slow
def test_resume_skips_a_symlinked_payload_even_one_pointing_inside(tmp_path: Path) -> None:
    """A real demo run; its newest checkpoint's state.pt is made a symlink to a file inside
    the same directory (identical bytes, hashes valid). The restarted run skips it, names
    why, resumes from the checkpoint before and ends bit-identical to the first run; the
    linked checkpoint's bytes are still in the run dir (whatever the writer did with it)."""
    run = tmp_path / "run"
    first = run_demo(run, steps=30, ckpt_every=10)
    assert first.returncode == 0, first.stdout + first.stderr
    newest = run / checkpoint_key(30)
    fingerprint = json.loads((newest / "manifest.json").read_bytes())["fingerprint"]
    (newest / "state.pt").rename(newest / "real.pt")
    (newest / "state.pt").symlink_to("real.pt")
    linked = {v for v in hashes(newest).values() if not v.startswith("link->")}
    again = run_demo(run, steps=30, ckpt_every=10)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output
    assert (
        "step_000030/state.pt: is a symlink (points inside the checkpoint directory); "
        "refusing to follow it" in output
    )
    assert "resumed from " + str(run / checkpoint_key(20)) in output
    assert json.loads((newest / "manifest.json").read_bytes())["fingerprint"] == fingerprint
    assert not (newest / "state.pt").is_symlink()
    assert linked <= set(hashes(run).values())  # real.pt and the old manifest: not deleted
    assert sorted(set(logged_steps(run))) == list(range(1, 31))
