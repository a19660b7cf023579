"""Async saves in process and through `runner demo`: a background failure, memory,
and the same checkpoints as sync saves.

- test_background_write_failure_on_a_full_tmpfs_*: a real full tmpfs fails the background
  save of step 4. step_done(4) returns before anything is said (the save is in flight: with
  sync saves the error is logged inside step_done(4) and this test fails); the failure is
  counted (runner_checkpoint_failures_total{stage="save"} = 1), logged once at the next step
  boundary with "training continues", step 2 stays byte for byte and verifies, no partial
  dir is left; once space returns the next save (step 6) commits and the run ends at 0.
- test_rss_stays_flat_over_100_async_saves: 100 async saves of a 25 MB state: VmRSS after the
  100th is within 2.5 MB (10% of the state) of VmRSS after the 10th, the host buffers hold
  no more than 1.1x the state's tensor bytes, and none once the session is closed.
- test_async_and_sync_demo_runs_write_the_same_checkpoints: `runner demo --steps 40
  --ckpt-every 5` in each save mode: same final fingerprint, and at every step the same
  manifest fingerprint and the same state.pt bytes; the logs say which mode saved.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import hashlib
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_dir
from runner.session.train_session import TrainSession
from runner.state.train_state import ModuleTrainState
from runner.storage.file import FileStorage
from tests.fixtures.async_saves import mounted_tmpfs
from tests.fixtures.ckpt import tree_hashes
from tests.fixtures.demo_process import demo_cmd, manifest
from tests.fixtures.train_loop import config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MB = 1_000_000


def square_state(width: int) -> ModuleTrainState:
    """Two width x width linear layers with AdamW (3 x 4 bytes per parameter once stepped)."""
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / width**0.5)
    return ModuleTrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))


def square_step(state: ModuleTrainState) -> None:
    width = state.model[0].in_features
    gen = torch.Generator().manual_seed(500 + state.counters.step)
    x = torch.randn(4, width, generator=gen)
    loss = (state.model(x) - x).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.advance(loss=float(loss.detach()), samples=4)


def tensor_bytes(state: ModuleTrainState) -> int:
    """Bytes of the model's and the optimizer's tensors (what a snapshot must copy, but for
    a few KB of RNG state)."""
    total = sum(t.numel() * t.element_size() for t in state.model.state_dict().values())
    for slots in state.optimizer.state_dict()["state"].values():
        total += sum(t.numel() * t.element_size() for t in slots.values() if torch.is_tensor(t))
    return total


def fill(path: Path) -> None:
    """Write zeros into `path` until its filesystem is full."""
    with open(path, "wb", buffering=0) as out:
        chunk = b"\0" * (1 << 16)
        try:
            while True:
                out.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


def failure_metric(session: TrainSession, stage: str) -> float | None:
    assert session.metrics is not None
    return session.metrics.registry.get_sample_value(
        "runner_checkpoint_failures_total", {"stage": stage}
    )


def test_background_write_failure_on_a_full_tmpfs_is_counted_reported_once_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with mounted_tmpfs(tmp_path / "disk", "8m") as disk:
        run_dir = disk / "run"
        ckpt_dir = run_dir / "checkpoints"
        cfg = config(
            tmp_path, run_dir=run_dir, mirror=False, steps=10, ckpt_every=2, keep=3,
            save_mode="async",
        )  # fmt: skip
        state = square_state(256)  # a 1.6 MB checkpoint
        caplog.set_level(logging.INFO)
        with TrainSession(cfg, state=state) as session:
            for _ in range(2):
                square_step(state)
                session.step_done()
            session.checkpointer.wait_for_saving()
            assert list_checkpoints(FileStorage(run_dir)) == [2]
            before = tree_hashes(ckpt_dir / "step_000002")

            fill(disk / "filler")
            with open(disk / "filler", "r+b") as filler:  # room for loss.jsonl, not a save
                filler.truncate(os.path.getsize(disk / "filler") - 256 * 1024)
            for _ in range(2):
                square_step(state)
                assert session.step_done() is False
            # step 4's save is handed to the saver: nothing said yet, whatever its state
            assert not [r for r in caplog.records if "training continues" in r.getMessage()]
            session.checkpointer.wait_for_saving()  # it has failed by now
            assert failure_metric(session, "save") == 1
            assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step_000002"]

            square_step(state)
            session.step_done()  # step 5's boundary reports step 4's failure
            said = [r for r in caplog.records if "training continues" in r.getMessage()]
            assert len(said) == 1, [r.getMessage() for r in said]
            message = said[0].getMessage()
            assert said[0].levelno == logging.ERROR
            assert "checkpoint at step 4 could not be written" in message
            assert "No space left on device" in message and "step 2 is intact" in message
            assert tree_hashes(ckpt_dir / "step_000002") == before
            assert verify_dir(ckpt_dir / "step_000002").step == 2

            (disk / "filler").unlink()  # space returns
            square_step(state)
            session.step_done()  # step 6: saved in the background, committed
            session.checkpointer.wait_for_saving()
            assert list_checkpoints(FileStorage(run_dir)) == [2, 6]
            assert verify_dir(ckpt_dir / "step_000006").fingerprint == state.fingerprint()
            while not session.should_stop:
                square_step(state)
                session.step_done()
        assert session.exit_code == 0
        assert list_checkpoints(FileStorage(run_dir)) == [6, 8, 10]
        assert failure_metric(session, "save") == 1
        assert failure_metric(session, "loss_log") == 0
        said = [r for r in caplog.records if "training continues" in r.getMessage()]
        assert len(said) == 1  # once, at step 5, never again
        assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-")]


def vm_rss() -> int:
    """VmRSS of this process once garbage is collected and glibc has handed its free heap
    pages back (malloc_trim): what is still allocated, not what the allocator keeps cached
    (without the trim its per-thread arenas grow RSS in steps of a few MB now and then)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.slow
def test_rss_stays_flat_over_100_async_saves(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "disk", "256m") as disk:  # page cache, not this RSS
        cfg = config(
            tmp_path, run_dir=disk / "run", mirror=False, steps=1000, ckpt_every=1, keep=2,
            save_mode="async",
        )  # fmt: skip
        state = square_state(1024)  # 2.1 M parameters: 25 MB with AdamW's m and v
        session = TrainSession(cfg, state=state)
        rss = {}
        try:
            assert session.restore() is None
            for step in range(1, 101):
                square_step(state)
                session.step_done()  # a save every step
                if step in (10, 100):
                    session.checkpointer.wait_for_saving()
                    rss[step] = vm_rss()
            buffers = session.checkpointer.snapshot_to
            assert buffers is not None
            held = buffers.nbytes
        finally:
            session.close()
        assert list_checkpoints(FileStorage(disk / "run")) == [99, 100]
    size = tensor_bytes(state)
    assert 25 * MB < size < 26 * MB
    growth = rss[100] - rss[10]
    print(f"state {size / MB:.1f} MB, VmRSS {rss[10] / MB:.1f} -> {rss[100] / MB:.1f} MB "
          f"({growth / 1e3:+.0f} kB), buffers {held / MB:.1f} MB")  # fmt: skip
    # 10% of the state: one leaked snapshot (or a buffer allocated per save) is 100%
    assert growth < 0.1 * size, f"VmRSS grew {growth / MB:.1f} MB over 90 saves"
    assert size <= held <= 1.1 * size
    assert buffers.nbytes == 0  # released when the session closed


_COMMITTED = re.compile(r"checkpoint step (\d+) committed in [0-9.]+s \(([^)]*)\)")
_FINGERPRINT = re.compile(r"step 40/40 fingerprint ([0-9a-f]{64})")


@pytest.mark.slow
def test_async_and_sync_demo_runs_write_the_same_checkpoints(tmp_path: Path) -> None:
    runs = {}
    for mode in ("async", "sync"):  # the two at once: two cores
        log = open(tmp_path / f"{mode}.log", "wb")  # noqa: SIM115 (closed below)
        cmd = demo_cmd(tmp_path / mode, "--save-mode", mode, "--keep", "10", steps=40, ckpt_every=5)
        runs[mode] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
    texts = {}
    for mode, (proc, log) in runs.items():
        try:
            assert proc.wait(timeout=120) == 0, (tmp_path / f"{mode}.log").read_text()
        finally:
            log.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        texts[mode] = (tmp_path / f"{mode}.log").read_text()

    fingerprints = {mode: _FINGERPRINT.findall(text) for mode, text in texts.items()}
    assert fingerprints["async"] == fingerprints["sync"] and len(fingerprints["async"]) == 1
    steps = list(range(5, 41, 5))
    for mode, text in texts.items():
        saved = {int(m[1]): m[2] for m in _COMMITTED.finditer(text)}
        assert sorted(saved) == steps, text
        label = re.compile(r", async, copied in \d+ ms$" if mode == "async" else r", sync$")
        assert all(label.search(how) for how in saved.values()), (mode, saved)
    for step in steps:
        a, s = (manifest(tmp_path / mode, step) for mode in ("async", "sync"))
        assert a["fingerprint"] == s["fingerprint"], step
        assert (a["step"], a["samples_seen"]) == (s["step"], s["samples_seen"]) == (step, step * 16)
        name = f"checkpoints/step_{step:06d}/state.pt"
        digest = {m: hashlib.sha256((tmp_path / m / name).read_bytes()).hexdigest() for m in runs}
        assert digest["async"] == digest["sync"], step
    assert manifest(tmp_path / "async", 40)["fingerprint"] == fingerprints["async"][0]
