"""Nothing set aside is deleted, end to end against a real SeaweedFS bucket: a re-base under
real torchrun (1 rank stopped by SIGTERM past step 52, resumed at 2 ranks with --keep 2) and a
`--fresh-start` over unusable checkpoints both de-commit the old lineage's steps, then the new
lineage commits and prunes those very step numbers. Every object a record that is not
`corrupt` names is still there with its size and sha256; a `corrupt` one's objects go."""

from __future__ import annotations

import hashlib
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.checkpoint.layout import manifest_key
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_dir
from runner.mirror import upload_checkpoint
from runner.storage import open_storage
from runner.storage.base import Storage
from tests.fixtures.aside_records import aside_records, keys_under, missing_or_changed
from tests.fixtures.cli_process import runner
from tests.fixtures.demo_process import checkpoint_steps, logged_steps, run_demo
from tests.fixtures.multirank import Plain, demo_args, rank_exits, wait_until
from tests.fixtures.s3 import SeaweedS3
from tests.fixtures.supervised import Supervised
from tests.fixtures.torchrun import Torchrun

pytestmark = pytest.mark.e2e

SUPERSEDED = "superseded-by-rescale"
STEPS = "150"  # at 2 ranks from step ~26 the new lineage reaches ~75: past the old 50 and 60


def step_prefix(step: int) -> str:
    return f"checkpoints/step_{step:06d}/"


def hashes(storage: Storage, keys: set[str]) -> dict[str, tuple[int, str]]:
    out = {}
    for key in keys:
        data = storage.get_bytes(key)
        out[key] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def test_a_rebase_keeps_every_object_its_superseded_records_name(
    s3_env: SeaweedS3,
    torchrun: Callable[..., Torchrun],
    plain_demo: Callable[..., Plain],
    tmp_path: Path,
) -> None:
    uri = f"s3://{s3_env.create_bucket()}/runs/rebased"
    storage = open_storage(uri)
    run_dir = tmp_path / "run"
    options = ("--mirror", uri, "--keep", "2", "--steps", STEPS)
    first = plain_demo(run_dir, *options)
    wait_until(
        lambda: max(logged_steps(run_dir), default=0) >= 52,
        lambda: first.proc.poll() is None,
        "step 52",
    )
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(90) == 75, first.output()
    stopped = checkpoint_steps(run_dir)[-1]
    older = list_checkpoints(storage)  # --keep 2: the stop step and the one before it
    assert older[-1] == stopped and len(older) == 2, older

    again = torchrun(2, demo_args(run_dir, *options))
    assert again.wait(300) == 0, again.output()
    assert rank_exits(again) == {0: 0, 1: 0}, again.output()
    out = again.rank_stderr(0)
    assert f"re-basing the run at step {stopped // 2} before training" in out, out

    records = aside_records(storage)
    assert [(r.step, r.reason) for r in records] == [(s, SUPERSEDED) for s in older], records
    below = older[0]  # a multiple of 10 that the new lineage committed again, then pruned
    assert f"checkpoint step {below} committed" in out, out
    assert below not in list_checkpoints(storage) and max(list_checkpoints(storage)) > below + 10
    # every object each record names: there, same size, same sha256
    assert {r.step: missing_or_changed(storage, r) for r in records} == {s: [] for s in older}
    # under the old step: the old lineage's payload alone (the new one's went with retention)
    assert keys_under(storage, step_prefix(below)) == set(records[0].files)

    # the sweep of debris keeps them too, and `runner prune` says so
    done = runner("prune", uri, "--keep", "2", "--orphan-age-hours", "0", "--json")
    assert done.returncode == 0, done.stderr
    named = sorted(key for r in records for key in r.files)
    pruned = json.loads(done.stdout)
    assert (pruned["deleted"], pruned["orphans_deleted"]) == ([], [])
    assert pruned["aside_kept"] == named
    assert {r.step: missing_or_changed(storage, r) for r in records} == {s: [] for s in older}

    # the run dir kept its own copies aside, whole
    local = sorted((run_dir / "aside").iterdir())
    assert [p.name.split("-")[0] for p in local] == [f"step_{s:06d}" for s in older]
    assert all(p.name.endswith(f"-{SUPERSEDED}") for p in local)
    for path in local:
        verify_dir(path)


def supervise(started: list[Supervised], run_dir: Path, uri: str, *, ranks: int) -> Supervised:
    """`runner run --mirror URI --keep 2 -- [torchrun --nproc-per-node N] runner demo ...`"""
    launcher = [sys.executable, "-m", "runner"]
    if ranks > 1:
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(ranks), "-m", "runner",
        ]  # fmt: skip
    args = [
        "--run-dir", str(run_dir), "--mirror", uri, "--keep", "2", "--grace-seconds", "60",
        "--", *launcher, *demo_args(run_dir, "--keep", "2", "--steps", STEPS)[2:],
    ]  # fmt: skip
    launch = Supervised(args, env={"OMP_NUM_THREADS": "1"})
    started.append(launch)
    return launch


def test_a_rebase_under_runner_run_keeps_every_object_its_superseded_records_name(
    s3_env: SeaweedS3, supervised_launches: list[Supervised], tmp_path: Path
) -> None:
    uri = f"s3://{s3_env.create_bucket()}/runs/supervised"
    storage = open_storage(uri)
    run_dir = tmp_path / "run"
    first = supervise(supervised_launches, run_dir, uri, ranks=1)
    wait_until(
        lambda: max(logged_steps(run_dir), default=0) >= 52,
        lambda: first.proc.poll() is None,
        "step 52",
    )
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(120) == 75, first.err
    older = list_checkpoints(storage)
    assert len(older) == 2 and older[-1] == checkpoint_steps(run_dir)[-1], older

    # Two ranks re-base the run at half the step. Only the mirror's steps above that are
    # superseded; one at or below it (uploads skipped on a loaded machine can leave step 20
    # there) is an ordinary older checkpoint that retention may prune.
    rebased = older[-1] // 2
    above = [s for s in older if s > rebased]
    again = supervise(supervised_launches, run_dir, uri, ranks=2)
    assert again.wait(300) == 0, again.err
    records = aside_records(storage)
    assert [(r.step, r.reason) for r in records] == [(s, SUPERSEDED) for s in above], again.err
    assert {r.step: missing_or_changed(storage, r) for r in records} == {s: [] for s in above}
    assert max(list_checkpoints(storage)) > above[0] + 10  # the new lineage went past them

    done = runner("prune", uri, "--keep", "2", "--orphan-age-hours", "0", "--json")
    assert done.returncode == 0, done.stderr
    pruned = json.loads(done.stdout)
    assert (pruned["deleted"], pruned["orphans_deleted"]) == ([], [])
    assert pruned["aside_kept"] == sorted(key for r in records for key in r.files)
    assert {r.step: missing_or_changed(storage, r) for r in records} == {s: [] for s in above}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 30-step demo run dir (checkpoints 10, 20, 30)."""
    run_dir = tmp_path_factory.mktemp("finished")
    done = run_demo(run_dir, steps=30, ckpt_every=10)
    assert done.returncode == 0, done.stderr
    return run_dir


def rewrite_manifest(storage: Storage, step: int, change: Callable[[dict], None]) -> None:
    data = json.loads(storage.get_bytes(manifest_key(step)))
    change(data)
    storage.delete(manifest_key(step))
    storage.put_bytes(manifest_key(step), json.dumps(data).encode())


def test_fresh_start_keeps_what_its_foreign_records_name_and_prunes_the_corrupt(
    s3_env: SeaweedS3, finished: Path, tmp_path: Path
) -> None:
    uri = f"s3://{s3_env.create_bucket()}/runs/fresh"
    storage = open_storage(uri)
    for step in (10, 20, 30):
        upload_checkpoint(storage, finished / "checkpoints" / f"step_{step:06d}")
    old = {s: keys_under(storage, step_prefix(s)) - {manifest_key(s)} for s in (10, 20, 30)}

    def newer_schema(data: dict) -> None:
        data["schema"] = "99"

    def newer_schema_other_files(data: dict) -> None:
        # a later schema may name its files in a shape this runner does not know
        data["schema"] = "99"
        data["files"] = [[f["path"], f["size"], f["sha256"]] for f in data["files"]]

    rewrite_manifest(storage, 10, newer_schema_other_files)
    rewrite_manifest(storage, 20, newer_schema)
    pt = next(k for k in old[30] if k.endswith("state.pt"))
    data = bytearray(storage.get_bytes(pt))
    data[len(data) // 2] ^= 0x01
    (tmp_path / "flipped").write_bytes(bytes(data))
    storage.put_file(pt, tmp_path / "flipped")
    before = {s: hashes(storage, old[s]) for s in (10, 20)}

    fresh = tmp_path / "fresh"
    done = run_demo(fresh, "--mirror", uri, "--fresh-start", "--keep", "2", steps=50, ckpt_every=10)
    assert done.returncode == 0, done.stderr
    assert "--fresh-start: 3 unusable checkpoint(s) set aside" in done.stderr
    records = aside_records_by_step(storage)
    assert records == {10: "foreign", 20: "foreign", 30: "corrupt"}
    # the new run committed 10..50 and pruned 10, 20 and 30
    assert list_checkpoints(storage) == [40, 50]
    assert all(f"checkpoint step {s} committed" in done.stderr for s in (10, 20, 30))
    # foreign: every old object there byte for byte (step 10's record cannot be read, so
    # nothing of its step went); corrupt: its payload went with the step's retention
    assert {s: hashes(storage, old[s]) for s in (10, 20)} == before
    assert keys_under(storage, step_prefix(20)) == old[20]
    assert old[10] < keys_under(storage, step_prefix(10))
    assert keys_under(storage, step_prefix(30)) == set()
    (readable,) = [r for r in aside_records(storage, skip_unreadable=True) if r.step == 20]
    assert missing_or_changed(storage, readable) == []

    swept = runner("prune", uri, "--keep", "2", "--orphan-age-hours", "0", "--json")
    assert swept.returncode == 0, swept.stderr
    pruned = json.loads(swept.stdout)
    assert (pruned["deleted"], pruned["orphans_deleted"]) == ([], [])
    assert pruned["aside_kept"] == sorted(
        keys_under(storage, step_prefix(10)) | keys_under(storage, step_prefix(20))
    )
    assert {s: hashes(storage, old[s]) for s in (10, 20)} == before


def aside_records_by_step(storage: Storage) -> dict[int, str]:
    """step -> reason of every aside record, read from the names alone."""
    found = {}
    for info in storage.list("aside/"):
        name, _when, reason = info.key.split("/")[1].split("-", 2)
        found[int(name.removeprefix("step_"))] = reason
    return found
