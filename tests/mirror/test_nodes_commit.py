"""The multi-node commit in the mirror (runner.mirror.nodes) on two real gloo ranks, each
"node" with a ckpt dir of its own and one shared file:// bucket (tests/e2e/test_multinode.py
launches real torchrun trees against S3).

One world runs every scenario in order (one launch: torch's import dominates) and prints what
each rank saw as JSON; the test asserts on both ranks' reports and on the bucket:
- a checkpoint committed at step 2 (the previous one the later scenarios must leave alone);
- rank 1's upload fails (a fake storage on rank 1 only): no manifest for step 4, the
  attempt's objects gone, step 2 intact, both ranks raise naming rank 1, no staging dir left;
- step 4 again, the manifest's put landing but its answer lost (a fake: the retry sees the
  key taken): the step already holds this same checkpoint, so it counts as committed and
  nothing is removed or replaced;
- step 4 saved again from the same state (another attempt): a duplicate by its fingerprint
  (DCP's index differs between two saves of one state), committed, the first copy kept;
- step 2 committed from another state: refused on every rank, the existing one untouched;
- step 2 loaded on both ranks through a recording storage: each rank reads only the files it
  needs, and gets the saved state back exactly.

"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runner.checkpoint.formats.dcp import DCP_METADATA, TRAIN_STATE_FILE, rank_file_name
from runner.checkpoint.layout import checkpoint_key, manifest_key
from runner.checkpoint.manifest import FORMAT_DCP
from runner.checkpoint.verify import verify_checkpoint
from runner.checkpoint.writer import CheckpointWriter
from runner.errors import StorageConflictError, StorageTransientError
from runner.mirror.upload import remote_manifest
from runner.state.train_state import ModuleTrainState
from runner.storage.file import FileStorage
from tests.fixtures.dcp_ranks import meta_of, module_state, train_steps
from tests.fixtures.recording_storage import RecordingStorage
from tests.fixtures.torchrun import GlooWorld

HERE = "tests.mirror.test_nodes_commit"
WORLD = 2


class _FakeUploadFails(FileStorage):
    """Fault injection (a fake): the put of rank 1's own rank file fails, after its DCP data
    file went up (so the attempt holds objects of this rank to remove)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.stored: list[str] = []

    def put_file(self, key: str, src: Path, **kw: Any) -> None:
        if key.endswith(rank_file_name(1)):
            raise StorageTransientError(f"{self.uri}/{key}: connection reset (injected)")
        super().put_file(key, src, **kw)
        self.stored.append(key)


class _FakeLostAnswer(FileStorage):
    """Fault injection (a fake): the manifest's create-only put lands but its answer is lost,
    and the retry finds the key taken (S3: 412), which is all the writer is told."""

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        super().put_bytes(key, data, if_absent=if_absent)
        if if_absent and key.endswith("/manifest.json"):
            raise StorageConflictError(f"{self.uri}/{key}: already exists (injected)")


def _keys(storage: FileStorage, step: int) -> list[str]:
    return sorted(info.key for info in storage.list(f"{checkpoint_key(step)}/"))


def _worker(base: str) -> None:
    from runner.collective.group import dedicated_group
    from runner.mirror.node_resume import load_from_bucket
    from runner.mirror.nodes import NodeBucket, commit_to_bucket

    group = dedicated_group(timeout_s=60)
    rank, root = group.rank, Path(base)
    plain = FileStorage(root / "bucket")
    ckpt_dir = root / f"node{rank}" / "checkpoints"  # each "node" its own disk
    writer = CheckpointWriter(ckpt_dir, run_id="r" * 16, writer_id=f"node{rank}")
    report: dict[str, Any] = {"rank": rank}

    def commit(state: ModuleTrainState, storage: FileStorage = plain) -> dict[str, Any]:
        part, meta = state.capture_ranked(rank=rank, world_size=WORLD), meta_of(state)
        bucket = NodeBucket(storage=storage, writer_id="test")
        try:
            done = commit_to_bucket(writer, part, meta=meta, group=group, bucket=bucket)
            outcome: dict[str, Any] = {"step": done.step, "in_store": done.store_uri is not None}
        except Exception as exc:
            outcome = {"error": type(exc).__name__, "message": str(exc)}
        # both ranks are past the outcome's broadcast: rank 0's clean-up has ended
        return {**outcome, "ckpt_dir": sorted(p.name for p in ckpt_dir.iterdir())}

    state = module_state(rank=rank, world=WORLD)
    train_steps(state, 2)
    saved_fingerprint = state.fingerprint()
    report["first"] = commit(state)

    train_steps(state, 2)
    faulty = _FakeUploadFails(plain.root)
    report["upload_fails"] = {
        **commit(state, faulty if rank == 1 else plain),
        "stored": faulty.stored,
        "step_4_after": _keys(plain, 4),
    }
    report["answer_lost"] = commit(state, _FakeLostAnswer(plain.root) if rank == 0 else plain)
    report["same_again"] = commit(state)  # the same state at step 4, another attempt

    other = module_state(1, rank=rank, world=WORLD)
    train_steps(other, 2)
    report["another"] = commit(other)

    recording = RecordingStorage(plain.root)
    loaded = module_state(rank=rank, world=WORLD)  # untrained: the load must bring step 2 back
    assert loaded.fingerprint() != saved_fingerprint
    remote = remote_manifest(plain, 2)
    assert remote is not None
    bucket = NodeBucket(storage=recording, writer_id="test")
    counters = load_from_bucket(loaded, remote, writer=writer, group=group, bucket=bucket)
    report["load"] = {
        "ops": recording.ops(),
        "counters": counters.to_dict(),
        "same_fingerprint": loaded.fingerprint() == saved_fingerprint,
        "ckpt_dir": sorted(p.name for p in ckpt_dir.iterdir()),
    }
    print(json.dumps(report))
    group.barrier()


@pytest.mark.slow
def test_commit_to_bucket_on_two_ranks_fake_faults_conflict_and_load(
    gloo_world: Callable[..., GlooWorld], tmp_path: Path
) -> None:
    world = gloo_world(f"{HERE}:_worker", WORLD, str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    finished = world.wait(timeout=120)
    assert [f.returncode for f in finished] == [0, 0], [f.stderr for f in finished]
    reports = [json.loads(f.stdout) for f in finished]
    assert [r["rank"] for r in reports] == [0, 1]
    bucket = FileStorage(tmp_path / "bucket")
    names = [DCP_METADATA, "__0_0.distcp", "__1_0.distcp", rank_file_name(0), rank_file_name(1)]
    names.append(TRAIN_STATE_FILE)

    # step 2: committed on both ranks, in the bucket only (no staging dir left on a node)
    for r in reports:
        assert r["first"] == {"step": 2, "in_store": True, "ckpt_dir": []}, r
    first = verify_checkpoint(bucket, 2)
    attempt = first.extra["mirror_attempt"]
    assert (first.world_size, first.format, first.samples_seen) == (2, FORMAT_DCP, 16)
    assert sorted(f.path for f in first.files) == sorted(f"{attempt}/{n}" for n in names)
    step2 = _keys(bucket, 2)
    assert step2 == sorted(
        [manifest_key(2), *(f"{checkpoint_key(2)}/{f.path}" for f in first.files)]
    )
    step2_manifest = bucket.get_bytes(manifest_key(2))

    # rank 1's upload failed: both ranks raise naming rank 1, nothing of step 4 remains
    failed0, failed1 = (r["upload_fails"] for r in reports)
    assert [key.rsplit("/", 1)[1] for key in failed1["stored"]] == ["__1_0.distcp"]  # went up
    for r, failed in ((0, failed0), (1, failed1)):
        assert failed["error"] == "CheckpointWriteError", failed
        mine = " (this one)" if r == 1 else ""
        assert re.fullmatch(
            re.escape(f"the checkpoint was not committed: rank 1: upload to {bucket.uri} failed: ")
            + re.escape(f"{bucket.uri}/{checkpoint_key(4)}/")
            + r"up-test-[0-9a-f]{10}/"
            + re.escape(f"{rank_file_name(1)}: connection reset (injected){mine}. Nothing ")
            + re.escape("partial is visible; the previous checkpoint is intact"),
            failed["message"],
        ), failed
        assert failed["ckpt_dir"] == [], failed  # the staging dirs are gone
        assert failed["step_4_after"] == [], failed  # no manifest, no object of the attempt

    # step 4's manifest landed, its answer lost: committed on both, kept whole
    for r in reports:
        assert r["answer_lost"] == {"step": 4, "in_store": True, "ckpt_dir": []}, r
    fourth = verify_checkpoint(bucket, 4)
    kept = fourth.extra["mirror_attempt"]
    assert (fourth.world_size, fourth.samples_seen) == (2, 32)
    assert _keys(bucket, 4) == sorted(
        [manifest_key(4), *(f"{checkpoint_key(4)}/{kept}/{n}" for n in names)]
    )
    # the same state saved at step 4 again (another attempt, so another DCP index): a
    # duplicate, committed on both; the first attempt stays, the second's objects are gone
    for r in reports:
        assert r["same_again"] == {"step": 4, "in_store": True, "ckpt_dir": []}, r
    assert verify_checkpoint(bucket, 4) == fourth
    assert _keys(bucket, 4) == sorted(
        [manifest_key(4), *(f"{checkpoint_key(4)}/{kept}/{n}" for n in names)]
    )

    # another good checkpoint at step 2: refused on both, nothing replaced; both ranks raise
    # the same error (training goes on after it on every rank, or on none)
    conflict, seen = reports[0]["another"], reports[1]["another"]
    why = (
        f"{bucket.uri} already holds a different checkpoint at step 2 that verifies "
        f"(written by node0, fingerprint {first.fingerprint[:12]}); not replacing it"
    )
    for r, outcome in ((0, conflict), (1, seen)):
        assert outcome["error"] == "CheckpointWriteError", outcome
        assert outcome["message"] == (
            f"the checkpoint was not committed: rank 0: the manifest was not written: {why}"
            f"{' (this one)' if r == 0 else ''}. Nothing partial is visible; the previous "
            "checkpoint is intact"
        ), outcome
    assert conflict["ckpt_dir"] == seen["ckpt_dir"] == []
    assert bucket.get_bytes(manifest_key(2)) == step2_manifest
    assert _keys(bucket, 2) == step2
    assert verify_checkpoint(bucket, 2) == first

    # the load: each rank fetched DCP's index, the shared state, its own rank file and the
    # data files its plan reads (both: DCP spread the replicated tensors over both files),
    # nothing else, each by a verified get_file
    for r in reports:
        load, rank = r["load"], r["rank"]
        reads = [DCP_METADATA, "__0_0.distcp", "__1_0.distcp", rank_file_name(rank)]
        reads.append(TRAIN_STATE_FILE)
        assert sorted(tuple(op) for op in load["ops"]) == sorted(
            ("get_file", f"{checkpoint_key(2)}/{attempt}/{n}") for n in reads
        ), load["ops"]
        assert load["same_fingerprint"] is True
        assert (load["counters"]["step"], load["counters"]["samples_seen"]) == (2, 16)
        assert load["ckpt_dir"] == []  # the scratch dir is gone
