"""A save that finds the disk full (a real tmpfs holding --keep checkpoints and no room for one
more) deletes the oldest checkpoint older than the newest verified one, cleans up and retries
once, in both save modes: one warning line per save, the first attempt counted once in
runner_checkpoint_failures_total{stage="save"}. When the retry fails too (a state that grew
past what one deletion frees), the save fails as it always did and training goes on."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_dir
from runner.session.train_session import TrainSession
from runner.storage.file import FileStorage
from tests.fixtures.async_saves import kill_state, kill_step, mounted_tmpfs
from tests.fixtures.train_loop import config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# kill_state's checkpoint takes 6.34 MB on a tmpfs: 22 MiB (23.07 MB) holds three and a half
DISK = "22m"
ROOM_LINE = re.compile(
    r"no room for checkpoint step (\d+) in \S+ \(No space left on device\): deleted step (\d+) "
    r"\(([\d.]+) MB freed\), the oldest checkpoint older than step (\d+), the newest "
    r"verified; the retry (committed it|failed too: .*)$"
)


def _metric(session: TrainSession, name: str, **labels: str) -> float | None:
    assert session.metrics is not None
    return session.metrics.registry.get_sample_value(name, labels)


def _room_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, int, float, int, str]]:
    found = []
    for record in caplog.records:
        match = ROOM_LINE.search(record.getMessage())
        if match is not None:
            assert record.levelno == logging.WARNING
            step, deleted, freed, newest, outcome = match.groups()
            found.append((int(step), int(deleted), float(freed), int(newest), outcome))
    return found


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_full_disk_save_deletes_the_oldest_older_than_the_newest_verified_and_commits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, save_mode: str
) -> None:
    with mounted_tmpfs(tmp_path / "disk", DISK) as disk:
        run_dir = disk / "run"
        cfg = config(
            tmp_path, run_dir=run_dir, mirror=False, steps=8, ckpt_every=1, keep=3,
            save_mode=save_mode,
        )  # fmt: skip
        state = kill_state()
        caplog.set_level(logging.INFO, logger="runner")
        with TrainSession(cfg, state=state) as session:
            while not session.should_stop:
                kill_step(state)
                session.step_done()
        assert session.exit_code == 0
        storage = FileStorage(run_dir)
        assert list_checkpoints(storage) == [6, 7, 8]
        for step in (6, 7, 8):
            assert verify_dir(run_dir / "checkpoints" / f"step_{step:06d}").step == step
        assert verify_dir(run_dir / "checkpoints" / "step_000008").fingerprint == (
            state.fingerprint()
        )
        assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]
    lines = _room_lines(caplog)
    # saves 1-3 fit; each later one deleted the oldest, never the newest verified (step - 1)
    assert [(s, d, n, o) for s, d, _f, n, o in lines] == [
        (step, step - 3, step - 1, "committed it") for step in range(4, 9)
    ]
    assert all(6.2 <= freed <= 6.4 for *_, freed, _n, _o in lines), lines
    assert "could not be written" not in caplog.text
    assert "training continues" not in caplog.text
    assert _metric(session, "runner_checkpoint_failures_total", stage="save") == 5.0
    # one commit and one stall per save: the retry is part of its save, not a save of its own
    assert _metric(session, "runner_checkpoint_save_duration_seconds_count") == 8.0
    assert _metric(session, "runner_checkpoint_stall_seconds_count") == 8.0
    assert _metric(session, "runner_checkpoint_last_step", location="local") == 8.0


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_full_disk_retry_that_fails_too_leaves_the_newest_verified_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, save_mode: str
) -> None:
    with mounted_tmpfs(tmp_path / "disk", DISK) as disk:
        run_dir = disk / "run"
        ckpt_dir = run_dir / "checkpoints"
        cfg = config(
            tmp_path, run_dir=run_dir, mirror=False, steps=5, ckpt_every=1, keep=3,
            save_mode=save_mode,
        )  # fmt: skip
        state = kill_state()
        caplog.set_level(logging.INFO, logger="runner")
        with TrainSession(cfg, state=state) as session:
            while not session.should_stop:
                if state.counters.step == 3:
                    # step 4's state is twice the size: one deletion does not make room
                    state.model.register_buffer("grown", torch.zeros(1_600_000))
                kill_step(state)
                session.step_done()
                if state.counters.step == 4:
                    state.model.register_buffer("grown", None)  # back to its size
        assert session.exit_code == 0
        assert list_checkpoints(FileStorage(run_dir)) == [2, 3, 5]
        for step in (2, 3, 5):
            assert verify_dir(ckpt_dir / f"step_{step:06d}").step == step
        assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".")]
    lines = _room_lines(caplog)
    assert [(s, d, n) for s, d, _f, n, _o in lines] == [(4, 1, 3)]
    assert lines[0][4].startswith("failed too: ") and "No space left" in lines[0][4]
    said = [r for r in caplog.records if "training continues" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.ERROR
    assert "checkpoint at step 4 could not be written" in said[0].getMessage()
    assert "the previous checkpoint: step 3 is intact" in said[0].getMessage()
    # two failed attempts at step 4's save; step 5 fitted at once
    assert _metric(session, "runner_checkpoint_failures_total", stage="save") == 2.0
    assert _metric(session, "runner_checkpoint_save_duration_seconds_count") == 4.0
