"""The checkpointer: capture then persist (SyncSaver), the fingerprint of what is saved, and
load_into, on a tiny real model with AdamW, a LambdaLR schedule and a ResumableSampler."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from runner.checkpoint.load import load_state
from runner.checkpoint.manifest import Manifest
from runner.checkpoint.verify import verify_dir
from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter, CommittedCheckpoint
from runner.session.capture import load_into
from runner.session.checkpointer import (
    Checkpointer,
    LoadsInto,
    Persist,
    Snapshot,
    SyncSaver,
    capture,
)
from runner.state.counters import Counters
from runner.state.fingerprint import fingerprint, fingerprint_state
from runner.state.host_copy import HostBuffers
from runner.state.sampler import ResumableSampler
from runner.state.train_state import ModuleTrainState
from tests.fixtures.savers import FakeInFlightSaver

SAMPLES = 40
BATCH = 4


def new_state(*, seed: int = 0) -> ModuleTrainState:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    sampler = ResumableSampler(SAMPLES, batch_size=BATCH, seed=0)  # one data order for all
    return ModuleTrainState(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)


def train_step(state: ModuleTrainState) -> None:
    """One step whose batch comes from the sampler and whose noise comes from the global RNG,
    so a resume is only exact when the sampler position and the RNG come back too."""
    indices = torch.tensor(state.sampler.next_batch() if state.sampler else [0], dtype=torch.float)
    x = indices.unsqueeze(1).repeat(1, 4) / SAMPLES + torch.randn(len(indices), 4)
    loss = state.model(x).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.advance(loss=float(loss.detach()))


def trained(steps: int, *, seed: int = 0) -> ModuleTrainState:
    torch.manual_seed(100 + seed)
    state = new_state(seed=seed)
    for _ in range(steps):
        train_step(state)
    return state


def writer(tmp_path: Path) -> CheckpointWriter:
    return CheckpointWriter(tmp_path / "checkpoints", run_id="run-1", writer_id="w")


def tensors_of(state: ModuleTrainState) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in state.model.state_dict().items()}
    for i, slots in state.optimizer.state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": v.clone() for k, v in slots.items()})
    return out


def assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


def test_capture_then_persist_writes_todays_bytes_and_fingerprint(tmp_path: Path) -> None:
    state = trained(3)
    live = fingerprint(state.model, state.optimizer)
    # today's inline save: capture, fingerprint of the live model, write_state
    counters = state.counters
    old_meta = CheckpointMeta(
        step=counters.step,
        samples_seen=counters.samples_seen,
        world_size=counters.world_size,
        epoch=counters.epoch,
        batch_in_epoch=counters.batch_in_epoch,
        fingerprint=state.fingerprint(),
        extra={"reason": "steps"},
    )
    old = writer(tmp_path / "old").write_state(state.capture(), meta=old_meta)

    snapshot = capture(state, reason="steps")
    assert snapshot.final_meta() == old_meta
    assert (snapshot.step, snapshot.reason, snapshot.final_meta().fingerprint) == (3, "steps", live)
    new = Checkpointer(writer(tmp_path / "new")).save(state, reason="steps").result()
    assert new.manifest.fingerprint == old.manifest.fingerprint == live
    assert new.manifest.format == old.manifest.format == "torch-state"
    assert [(f.path, f.size, f.sha256) for f in new.manifest.files] == [
        (f.path, f.size, f.sha256) for f in old.manifest.files
    ]
    assert (new.path / "state.pt").read_bytes() == (old.path / "state.pt").read_bytes()
    assert new.manifest.extra == {"reason": "steps"}


def test_the_fingerprint_is_of_the_snapshot_not_the_live_model(tmp_path: Path) -> None:
    state = trained(2)
    before = state.fingerprint()
    payload = state.capture(copy=True)  # what a background saver will hold: host copies
    train_step(state)
    assert state.fingerprint() != before
    assert state.fingerprint_captured(payload) == before
    assert fingerprint_state(payload["model"], payload["optimizer"]) == before


def test_a_copied_snapshot_shares_no_tensor_with_the_live_state_and_fingerprints_the_same(
    tmp_path: Path,
) -> None:
    state = trained(2)
    digest = state.fingerprint()
    snapshot = capture(state, reason="steps", copy_into=HostBuffers())
    assert snapshot.final_meta().fingerprint == digest
    live = {p.data_ptr() for p in state.model.parameters()}
    assert not live & {t.data_ptr() for t in snapshot.payload["model"].values()}
    train_step(state)
    assert state.fingerprint() != digest
    committed = Checkpointer(writer(tmp_path)).persist(snapshot)
    loaded = load_state(committed.path)
    assert fingerprint_state(loaded["model"], loaded["optimizer"]) == digest
    assert committed.manifest.fingerprint == digest


def test_a_state_mutated_after_persist_returns_leaves_the_checkpoint_as_committed(
    tmp_path: Path,
) -> None:
    state = trained(3)
    want = tensors_of(state)
    digest = state.fingerprint()
    committed = Checkpointer(writer(tmp_path)).save(state, reason="steps").result()
    on_disk = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in committed.path.iterdir()}
    for _ in range(3):
        train_step(state)  # in-place updates of the very tensors the snapshot referenced
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    assert state.fingerprint() != digest
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in committed.path.iterdir()}
    assert after == on_disk
    assert verify_dir(committed.path).fingerprint == digest
    loaded = load_state(committed.path)
    assert fingerprint_state(loaded["model"], loaded["optimizer"]) == digest
    got = {f"model/{k}": v for k, v in loaded["model"].items()}
    got.update(
        {
            f"opt/{i}/{k}": v
            for i, slots in loaded["optimizer"]["state"].items()
            for k, v in slots.items()
        }
    )
    assert_equal_tensors(got, want)


def test_load_into_restores_every_part_bit_exactly_and_training_continues_identically(
    tmp_path: Path,
) -> None:
    source = trained(5)
    committed = Checkpointer(writer(tmp_path)).save(source, reason="steps").result()
    want = tensors_of(source)
    rng_after_save = torch.get_rng_state()

    target = trained(2, seed=9)  # other weights, optimizer, sampler position, schedule, RNG
    torch.manual_seed(12345)
    assert isinstance(target, LoadsInto)
    counters = load_into(
        target, lambda _template: Checkpointer.read(committed.path, committed.manifest)
    )
    assert counters == source.counters == target.counters
    assert counters.step == 5
    assert target.loss_history == source.loss_history
    assert_equal_tensors(tensors_of(target), want)
    assert target.fingerprint() == committed.manifest.fingerprint
    assert target.scheduler.state_dict() == source.scheduler.state_dict()
    assert target.sampler is not None and source.sampler is not None
    assert target.sampler.state_dict() == source.sampler.state_dict()
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    for _ in range(3):
        train_step(source)
    torch.set_rng_state(rng_after_save)
    for _ in range(3):
        train_step(target)
    assert target.fingerprint() == source.fingerprint()
    assert target.loss_history == source.loss_history


def test_load_into_hands_the_reader_the_live_state_as_its_template(tmp_path: Path) -> None:
    state = trained(2)
    committed = Checkpointer(writer(tmp_path)).save(state, reason="steps").result()
    target = trained(1, seed=3)
    seen: list[dict[str, Any]] = []

    def read(template: dict[str, Any]) -> dict[str, Any]:
        seen.append(template)
        return Checkpointer.read(committed.path, committed.manifest)

    target.load_into(read)
    (template,) = seen
    assert template["param_names"] == [n for n, _ in target.model.named_parameters()]
    # the template's tensors are the live ones: an in-place (DCP) reader fills the model itself
    live = dict(target.model.named_parameters())
    assert all(template["model"][n].data_ptr() == p.data_ptr() for n, p in live.items())


class OldProtocolState:
    """A user's TrainState written against the first protocol: capture, restore, fingerprint
    and nothing else (no load_into, no fingerprint_captured)."""

    def __init__(self, value: float) -> None:
        self.weight = torch.full((3,), value)
        self.counters = Counters(step=1, samples_seen=4)
        self.loss_history = [0.5]
        self.fingerprints = 0

    def capture(self, *, copy: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"counters": self.counters.to_dict(), "weight": self.weight, "extra": {}}

    def restore(self, state: dict[str, Any], *, restore_rng: bool = True) -> Counters:
        self.weight = state["weight"].clone()
        self.counters = Counters.from_dict(state["counters"])
        return self.counters

    def fingerprint(self) -> str:
        self.fingerprints += 1
        return hashlib.sha256(self.weight.numpy().tobytes()).hexdigest()


def test_a_state_of_the_old_protocol_saves_with_its_own_fingerprint_and_loads(
    tmp_path: Path,
) -> None:
    old = OldProtocolState(2.0)
    assert not isinstance(old, LoadsInto)
    committed = Checkpointer(writer(tmp_path)).save(old, reason="steps").result()
    assert old.fingerprints == 1
    assert (
        committed.manifest.fingerprint == hashlib.sha256(old.weight.numpy().tobytes()).hexdigest()
    )
    other = OldProtocolState(7.0)
    other.counters = Counters()
    ckpt = Checkpointer(writer(tmp_path))
    counters = ckpt.load_checkpoint_into(committed.path, committed.manifest, other)
    assert (counters.step, counters.samples_seen) == (1, 4)
    assert torch.equal(other.weight, torch.full((3,), 2.0))


def test_persist_runs_commit_bookkeeping_retention_hand_off_in_order(tmp_path: Path) -> None:
    calls: list[str] = []

    def on_commit(committed: CommittedCheckpoint, snapshot: Snapshot) -> None:
        assert (committed.path / "manifest.json").is_file()  # committed before bookkeeping
        calls.append(f"commit {snapshot.step} {snapshot.reason}")

    def hand_off(committed: CommittedCheckpoint, snapshot: Snapshot) -> None:
        calls.append(f"hand off {committed.step}")

    ckpt = Checkpointer(
        writer(tmp_path),
        on_commit=on_commit,
        retention=lambda: calls.append("retention"),
        hand_off=hand_off,
    )
    state = trained(2)
    assert ckpt.wait_for_saving() is None
    committed = ckpt.save(state, reason="signal").result()
    assert calls == ["commit 2 signal", "retention", "hand off 2"]
    assert ckpt.wait_for_saving() == committed
    ckpt.close()


def test_fake_in_flight_saver_each_save_first_waits_for_the_one_in_flight(tmp_path: Path) -> None:
    holder: list[FakeInFlightSaver] = []

    def make(persist: Persist) -> FakeInFlightSaver:
        holder.append(FakeInFlightSaver(persist))
        return holder[0]

    ckpt = Checkpointer(writer(tmp_path), saver=make)
    state = trained(1)
    ckpt.save(state, reason="steps")
    train_step(state)
    ckpt.save(state, reason="steps")
    ckpt.close()
    assert holder[0].events == ["save 1", "wait 1", "save 2", "wait 2", "close"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000001",
        "step_000002",
    ]


def test_sync_saver_has_nothing_in_flight_after_save(tmp_path: Path) -> None:
    persisted: list[int] = []
    committed = CommittedCheckpoint(step=1, path=tmp_path, manifest=Manifest.__new__(Manifest))

    def persist(snapshot: Snapshot) -> CommittedCheckpoint:
        persisted.append(snapshot.step)
        return committed

    saver = SyncSaver(persist)
    assert saver.wait_for_saving() is None
    handle = saver.save(capture(trained(1), reason="steps"))
    assert persisted == [1]
    assert handle.result() is committed and saver.wait_for_saving() is committed


def test_load_checkpoint_into_restores_a_module_state(tmp_path: Path) -> None:
    # (was a test of TrainSession._load_checkpoint, removed: restore reads in the resolver's
    # worker and loads on the loop's thread, test_train_session pins that bit-exact)
    source = trained(4)
    committed = CheckpointWriter(
        tmp_path / "run" / "checkpoints", run_id="r", writer_id="pod-a"
    ).write_state(source.capture(), meta=capture(source, reason="steps").final_meta())
    target = trained(1, seed=5)
    ckpt = Checkpointer(writer(tmp_path / "other"))
    counters = ckpt.load_checkpoint_into(committed.path, committed.manifest, target)
    assert counters == source.counters
    assert target.fingerprint() == source.fingerprint() == committed.manifest.fingerprint
    assert_equal_tensors(tensors_of(target), tensors_of(source))
