"""Resume or refuse, never replace, with real `runner` processes on
a local run dir, a file:// mirror and the SeaweedFS S3 server. Every checkpoint file is hashed
before and after to prove nothing usable was changed, replaced, pruned or deleted."""

from __future__ import annotations

import datetime
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from runner.atomicity.files import sha256_file
from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.retention import prune
from runner.checkpoint.verify import verify_checkpoint, verify_dir
from runner.mirror import upload_checkpoint
from runner.storage import open_storage
from runner.storage.base import Storage
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import tree_hashes
from tests.fixtures.demo_process import manifest, run_demo
from tests.fixtures.s3 import SeaweedS3

STEPS = 30
EVERY = 10


def demo(run_dir: Path, *extra: str, env: dict[str, str] | None = None, steps: int = STEPS):
    return run_demo(run_dir, *extra, env=env, steps=steps, ckpt_every=EVERY)


def runner(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "runner", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir of a finished 30-step demo (checkpoints 10, 20, 30), made once."""
    run_dir = tmp_path_factory.mktemp("finished")
    done = demo(run_dir)
    assert done.returncode == 0, done.stderr
    return run_dir


@pytest.fixture
def run_copy(finished: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(finished, dst)
    return dst


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def refresh_hashes(ckpt: Path) -> None:
    data = json.loads((ckpt / "manifest.json").read_bytes())
    for f in data["files"]:
        f["size"], f["sha256"] = sha256_file(ckpt / f["path"])
    (ckpt / "manifest.json").write_text(json.dumps(data))


# -- ways to make every checkpoint of a run dir unusable --------------------------------------


def corrupt_each(run_dir: Path) -> None:
    for step in (10, 20, 30):
        flip_byte(step_dir(run_dir, step) / "state.pt")


def newer_schema(run_dir: Path) -> None:
    for step in (10, 20, 30):
        path = step_dir(run_dir, step) / "manifest.json"
        data = json.loads(path.read_bytes())
        data["schema"] = "99"
        path.write_text(json.dumps(data))


def payload_weights_only_refuses(run_dir: Path) -> None:
    for step in (10, 20, 30):
        ckpt = step_dir(run_dir, step)
        torch.save({"schema": "2", "when": datetime.datetime(2026, 1, 1)}, ckpt / "state.pt")
        refresh_hashes(ckpt)


def seed_bin_converted_in(run_dir: Path) -> None:
    seed = run_dir.parent / "step_000030.bin"
    done = runner("convert", str(step_dir(run_dir, 30)), str(seed))
    assert done.returncode == 0, done.stderr
    shutil.rmtree(run_dir / "checkpoints")
    done = runner("convert", str(seed), str(run_dir))
    assert done.returncode == 0, done.stderr


def seed_bin_waiting(run_dir: Path) -> None:
    seed = run_dir / "checkpoints" / "step_000030.bin"
    done = runner("convert", str(step_dir(run_dir, 30)), str(seed))
    assert done.returncode == 0, done.stderr
    for step in (10, 20, 30):
        shutil.rmtree(step_dir(run_dir, step))


BREAKAGES: dict[str, Callable[[Path], None]] = {
    "flipped-byte-in-each": corrupt_each,
    "newer-schema": newer_schema,
    "weights-only-refuses": payload_weights_only_refuses,
    "seed-bin-converted-in": seed_bin_converted_in,
    "seed-bin-waiting": seed_bin_waiting,
}


@pytest.mark.slow
@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_demo_refuses_with_exit_3_and_writes_nothing(run_copy: Path, breakage: str) -> None:
    BREAKAGES[breakage](run_copy)
    before = tree_hashes(run_copy)
    done = demo(run_copy, steps=40)
    assert done.returncode == 3, done.stderr
    assert "refusing to start" in done.stderr and "--fresh-start" in done.stderr
    assert "Traceback" not in done.stderr
    assert tree_hashes(run_copy) == before  # nothing replaced, pruned, appended or deleted
    assert not (run_copy / "aside").exists()


@pytest.mark.slow
def test_fresh_start_sets_unusable_checkpoints_aside_and_trains_as_a_new_run(
    run_copy: Path, finished: Path
) -> None:
    corrupt_each(run_copy)
    corrupt = {s: tree_hashes(step_dir(run_copy, s)) for s in (10, 20, 30)}
    done = demo(run_copy, "--fresh-start")
    assert done.returncode == 0, done.stderr
    assert "set aside" in done.stderr
    # a new run from step 0 reaches exactly the state of the first one
    assert manifest(run_copy, STEPS)["fingerprint"] == manifest(finished, STEPS)["fingerprint"]
    # every corrupt checkpoint is kept, byte for byte, under aside/
    aside = sorted((run_copy / "aside").iterdir())
    assert [p.name.split("-")[0] for p in aside] == ["step_000010", "step_000020", "step_000030"]
    assert [tree_hashes(p) for p in aside] == [corrupt[10], corrupt[20], corrupt[30]]


@pytest.mark.slow
def test_fresh_start_never_discards_a_usable_checkpoint(run_copy: Path) -> None:
    flip_byte(step_dir(run_copy, 30) / "state.pt")
    good = {s: tree_hashes(step_dir(run_copy, s)) for s in (10, 20)}
    # set in the environment, as a deploy file would leave it
    done = demo(run_copy, env={"RUNNER_FRESH_START": "1"}, steps=STEPS)
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stderr and "step_000020" in done.stderr
    assert {s: tree_hashes(step_dir(run_copy, s)) for s in (10, 20)} == good
    verify_dir(step_dir(run_copy, 30))  # redone; the corrupt copy set aside, not deleted
    (aside,) = (run_copy / "aside").iterdir()
    assert aside.name.startswith("step_000030-") and aside.name.endswith("-corrupt")


@pytest.mark.slow
def test_runner_run_refuses_too(run_copy: Path) -> None:
    newer_schema(run_copy)
    before = tree_hashes(run_copy)
    done = runner("run", "--run-dir", str(run_copy), "--", sys.executable, "-c", "print('trained')")
    assert done.returncode == 3, done.stderr
    assert "refusing to start" in done.stderr and "trained" not in done.stdout
    assert tree_hashes(run_copy) == before


# -- the mirror: file:// and S3 ---------------------------------------------------------------


def bucket_hashes(storage: Storage) -> dict[str, str]:
    out = {}
    for info in storage.list(""):
        with storage.open_read(info.key) as f:
            out[info.key] = hashlib.sha256(f.read()).hexdigest()
    return out


def corrupt_remote(storage: Storage, step: int) -> None:
    """Flip one byte of the step's payload in place (same size, same key)."""
    key = next(
        i.key for i in storage.list(f"checkpoints/step_{step:06d}/") if i.key.endswith("state.pt")
    )
    data = bytearray(storage.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    tmp = Path(f"/tmp/corrupt-{step}-{hashlib.sha256(key.encode()).hexdigest()[:8]}")
    tmp.write_bytes(bytes(data))
    storage.put_file(key, tmp)
    tmp.unlink()


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.e2e)])
def mirror(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A mirror location and the environment a subprocess needs to reach it."""
    if request.param == "file":
        return f"file://{tmp_path / 'bucket'}", {}
    s3: SeaweedS3 = request.getfixturevalue("s3_server")
    return f"s3://{s3.create_bucket()}/runs/r1", s3.env()


@pytest.fixture
def s3_env_for(mirror: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> Storage:
    """This process's storage client for the mirror (for setting up and asserting)."""
    for name, value in mirror[1].items():
        monkeypatch.setenv(name, value)
    return open_storage(mirror[0])


@pytest.mark.slow
def test_mirror_holding_only_corrupt_checkpoints_refuses_a_fresh_node(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    for step in (10, 20, 30):
        upload_checkpoint(storage, step_dir(finished, step))
        corrupt_remote(storage, step)
    before = bucket_hashes(storage)
    fresh = tmp_path / "fresh"
    done = demo(fresh, "--mirror", location, env=env)
    assert done.returncode == 3, done.stderr
    assert "refusing to start" in done.stderr and location in done.stderr
    assert bucket_hashes(storage) == before
    assert list_checkpoints(FileStorage(fresh)) == []


@pytest.mark.slow
def test_corrupt_remote_step_is_healed_by_a_resumed_run(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    for step in (10, 20):
        upload_checkpoint(storage, step_dir(finished, step))
    corrupt_remote(storage, 20)
    with pytest.raises(Exception, match="sha256"):
        verify_checkpoint(storage, 20)
    fresh = tmp_path / "fresh"
    done = demo(fresh, "--mirror", location, env=env)
    assert done.returncode == 0, done.stderr
    assert "not resuming from step 20" in done.stderr
    healed = verify_checkpoint(storage, 20)
    assert healed.fingerprint == manifest(finished, 20)["fingerprint"]
    assert verify_checkpoint(storage, 30).fingerprint == manifest(finished, 30)["fingerprint"]
    # the corrupt copy's manifest is kept aside, not deleted
    assert any(i.key.startswith("aside/step_000020-") for i in storage.list("aside/"))


@pytest.mark.slow
def test_corrupt_remote_step_is_healed_by_push(
    finished: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    upload_checkpoint(storage, step_dir(finished, 20))
    corrupt_remote(storage, 20)
    done = runner("push", str(finished), location, "--step", "20", env=env)
    assert done.returncode == 0, done.stderr
    assert verify_checkpoint(storage, 20).fingerprint == manifest(finished, 20)["fingerprint"]


@pytest.mark.slow
def test_corrupt_remote_step_is_healed_by_repair(
    finished: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    for step in (10, 20):
        upload_checkpoint(storage, step_dir(finished, step))
    corrupt_remote(storage, 20)
    good_10 = {k: v for k, v in bucket_hashes(storage).items() if "step_000010" in k}
    done = runner("repair", location, "--from", str(finished), env=env)
    assert done.returncode == 0, done.stderr
    assert "step 20: restored" in done.stdout
    assert verify_checkpoint(storage, 20).fingerprint == manifest(finished, 20)["fingerprint"]
    assert {k: v for k, v in bucket_hashes(storage).items() if "step_000010" in k} == good_10


@pytest.mark.slow
def test_repair_without_a_source_sets_the_corrupt_step_aside_and_exits_3(
    finished: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    for step in (10, 20):
        upload_checkpoint(storage, step_dir(finished, step))
    corrupt_remote(storage, 20)
    done = runner("repair", location, env=env)
    assert done.returncode == 3, done.stderr
    assert "set aside" in done.stderr and "--from" in done.stderr
    assert list_checkpoints(storage) == [10]
    # now the step is free: a push of a good copy lands
    upload_checkpoint(storage, step_dir(finished, 20))
    verify_checkpoint(storage, 20)


@pytest.mark.slow
def test_a_verified_remote_step_with_other_contents_is_never_replaced(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    other = tmp_path / "other"
    done = demo(other, "--seed", "7", steps=20)
    assert done.returncode == 0, done.stderr
    upload_checkpoint(storage, step_dir(other, 20))
    before = bucket_hashes(storage)
    done = runner("push", str(finished), location, "--step", "20", env=env)
    assert done.returncode != 0
    assert "not replacing it" in done.stderr
    assert bucket_hashes(storage) == before


# -- retention ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_retention_never_counts_an_unusable_checkpoint_among_the_k_kept(
    finished: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    extra = tmp_path / "extra"
    done = demo(extra, steps=50)
    assert done.returncode == 0, done.stderr
    for step in (40, 50):
        shutil.copytree(step_dir(extra, step), step_dir(run_dir, step))
        flip_byte(step_dir(run_dir, step) / "state.pt")  # the two newest are corrupt
    newer_schema_dir = step_dir(run_dir, 10)  # the oldest is of a newer schema
    data = json.loads((newer_schema_dir / "manifest.json").read_bytes())
    data["schema"] = "99"
    (newer_schema_dir / "manifest.json").write_text(json.dumps(data))
    before = tree_hashes(run_dir / "checkpoints")
    deleted = prune(FileStorage(run_dir), keep=2)
    # kept and counted: 30, 20 (good); 50, 40 corrupt: not counted, not deleted; 10: foreign
    assert deleted == []
    assert tree_hashes(run_dir / "checkpoints") == before


@pytest.mark.slow
def test_repair_of_a_run_dir_restores_from_a_mirror_and_keeps_the_corrupt_copy_aside(
    finished: Path, run_copy: Path, tmp_path: Path
) -> None:
    bucket = f"file://{tmp_path / 'bucket'}"
    upload_checkpoint(open_storage(bucket), step_dir(finished, 20))
    flip_byte(step_dir(run_copy, 20) / "state.pt")
    corrupt = tree_hashes(step_dir(run_copy, 20))
    good = {s: tree_hashes(step_dir(run_copy, s)) for s in (10, 30)}
    done = runner("repair", str(run_copy), "--from", bucket)
    assert done.returncode == 0, done.stderr
    assert tree_hashes(step_dir(run_copy, 20)) == tree_hashes(step_dir(finished, 20))
    assert {s: tree_hashes(step_dir(run_copy, s)) for s in (10, 30)} == good
    (aside,) = (run_copy / "aside").iterdir()
    assert tree_hashes(aside) == corrupt
    again = runner("repair", str(run_copy))
    assert again.returncode == 0 and "nothing to repair" in again.stdout


def test_train_session_refuses_in_process_and_writes_nothing(run_copy: Path) -> None:
    from runner.config import RunConfig
    from runner.errors import UnusableCheckpointsError
    from runner.session.train_session import TrainSession
    from runner.state.train_state import ModuleTrainState

    newer_schema(run_copy)
    before = tree_hashes(run_copy)
    model = torch.nn.Linear(4, 2)
    state = ModuleTrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with (
        pytest.raises(UnusableCheckpointsError, match="refusing to start") as caught,
        TrainSession(RunConfig(run_dir=run_copy, steps=40), state=state),
    ):
        pass
    assert all(f"step {s}:" in str(caught.value) for s in (10, 20, 30))
    assert caught.value.exit_code == 3
    assert tree_hashes(run_copy) == before
    assert state.counters.step == 0
    # the lock went with the session: another one starts at once (and refuses again)
    with pytest.raises(UnusableCheckpointsError):
        TrainSession(RunConfig(run_dir=run_copy, steps=40), state=state).__enter__()


@pytest.mark.slow
def test_fresh_start_with_a_mirror_decommits_unusable_remote_checkpoints_keeping_them(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    for step in (10, 20, 30):
        upload_checkpoint(storage, step_dir(finished, step))
        corrupt_remote(storage, step)
    manifests = {
        s: storage.get_bytes(f"checkpoints/step_{s:06d}/manifest.json") for s in (10, 20, 30)
    }
    payload = {k: v for k, v in bucket_hashes(storage).items() if not k.endswith("manifest.json")}
    fresh = tmp_path / "fresh"
    done = demo(fresh, "--mirror", location, "--fresh-start", env=env)
    assert done.returncode == 0, done.stderr
    # a new run from step 0, mirrored: the same state the first one reached
    assert verify_checkpoint(storage, 30).fingerprint == manifest(finished, 30)["fingerprint"]
    # each old manifest kept byte for byte under aside/, each old payload object still there
    records = {
        i.key.split("/")[1].split("-")[0]: storage.get_bytes(i.key) for i in storage.list("aside/")
    }
    assert records == {f"step_{s:06d}": manifests[s] for s in (10, 20, 30)}
    after = bucket_hashes(storage)
    assert all(after.get(k) == v for k, v in payload.items())


@pytest.mark.slow
def test_prune_of_a_mirror_hashes_what_it_counts(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    extra = tmp_path / "extra"
    done = demo(extra, steps=50)
    assert done.returncode == 0, done.stderr
    for step in (10, 20):
        upload_checkpoint(storage, step_dir(finished, step))
    for step in (40, 50):  # same sizes, one flipped byte each: only a hash tells
        upload_checkpoint(storage, step_dir(extra, step))
        corrupt_remote(storage, step)
    before = bucket_hashes(storage)
    done = runner("prune", location, "--keep", "2", env=env)
    assert done.returncode == 0, done.stderr
    assert bucket_hashes(storage) == before  # 20 and 10 are the 2 kept; 50, 40 uncounted
    assert list_checkpoints(storage) == [10, 20, 40, 50]


@pytest.mark.slow
def test_a_payload_this_torch_cannot_load_is_never_decommitted_by_a_resumed_run(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    upload_checkpoint(storage, step_dir(finished, 10))
    foreign = tmp_path / "foreign"
    shutil.copytree(finished, foreign)
    payload_weights_only_refuses(foreign)  # hashes refreshed: it verifies, it does not load
    upload_checkpoint(storage, step_dir(foreign, 20))
    before = {k: v for k, v in bucket_hashes(storage).items() if "step_000020" in k}
    fresh = tmp_path / "fresh"
    done = demo(fresh, "--mirror", location, env=env)
    assert done.returncode == 0, done.stderr
    assert "not resuming from step 20" in done.stderr
    assert "resuming from step 10" in done.stderr
    # the retrained step 20 met it in the bucket and left it as it was
    assert "never replaced" in done.stderr
    assert {k: v for k, v in bucket_hashes(storage).items() if "step_000020" in k} == before
    assert list(storage.list("aside/")) == []


@pytest.mark.slow
def test_repair_from_a_file_mirror_uploads_a_copy_that_verifies(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    source = f"file://{tmp_path / 'source-bucket'}"
    upload_checkpoint(open_storage(source), step_dir(finished, 20))
    upload_checkpoint(storage, step_dir(finished, 20))
    corrupt_remote(storage, 20)
    done = runner("repair", location, "--from", source, env=env)
    assert done.returncode == 0, done.stderr
    assert verify_checkpoint(storage, 20).fingerprint == manifest(finished, 20)["fingerprint"]
    fresh = tmp_path / "fresh"
    pulled = runner("pull", location, str(fresh), env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert tree_hashes(step_dir(fresh, 20)) == tree_hashes(step_dir(finished, 20))


@pytest.mark.slow
def test_a_forged_v1_hint_cannot_switch_off_the_step_check(run_copy: Path) -> None:
    forged = step_dir(run_copy, 999_999_999)
    shutil.copytree(step_dir(run_copy, 30), forged)
    data = json.loads((forged / "manifest.json").read_bytes())
    data["step"] = 999_999_999
    data["extra"] = {**data.get("extra", {}), "migrated_from": "1", "v1_counters": []}
    (forged / "manifest.json").write_text(json.dumps(data))
    done = runner("verify", str(run_copy), "--step", "999999999")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "(step: manifest 999999999, payload 30" in done.stdout + done.stderr


@pytest.mark.slow
def test_a_local_resume_heals_a_truncated_mirror_copy_of_its_step(
    finished: Path, tmp_path: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    location, env = mirror
    storage = s3_env_for
    run_dir = tmp_path / "run"
    done = demo(run_dir, "--mirror", location, env=env, steps=20)
    assert done.returncode == 0, done.stderr
    key = next(i.key for i in storage.list("checkpoints/step_000020/") if i.key.endswith(".pt"))
    short = tmp_path / "short"
    short.write_bytes(storage.get_bytes(key)[:-100])
    storage.put_file(key, short)  # the bucket's copy of step 20 is now truncated
    done = demo(run_dir, "--mirror", location, env=env)  # resumes from the local step 20
    assert done.returncode == 0, done.stderr
    assert "resuming from local checkpoint step 20" in done.stderr
    assert "copy of step 20 is damaged" in done.stderr
    assert verify_checkpoint(storage, 20).fingerprint == manifest(finished, 20)["fingerprint"]
    assert verify_checkpoint(storage, 30).fingerprint == manifest(finished, 30)["fingerprint"]


def test_retention_spares_the_payload_of_a_foreign_decommitted_checkpoint(
    finished: Path, mirror: tuple[str, dict[str, str]], s3_env_for: Storage
) -> None:
    from runner.checkpoint.aside import FOREIGN, decommit_remote

    storage = s3_env_for
    upload_checkpoint(storage, step_dir(finished, 10))
    old = {k: v for k, v in bucket_hashes(storage).items() if not k.endswith("manifest.json")}
    decommit_remote(storage, 10, reason=FOREIGN)  # what --fresh-start does to a foreign one
    for step in (10, 20, 30):  # the new run commits step 10 again, then two more
        upload_checkpoint(storage, step_dir(finished, step))
    assert prune(storage, keep=2) == [10]
    after = bucket_hashes(storage)
    assert {k: after.get(k) for k in old} == old  # every object the record names is still there
    assert not any(k.startswith("checkpoints/step_000010/") for k in set(after) - set(old))
