"""runner.integrations.spot without a framework: a trainer's checkpoint directory committed
at a stop agreed after a step, the exit code, the resume put back under the output dir, and a
run dir that holds another kind of checkpoint refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.checkpoint.verify import verify_checkpoint
from runner.config import RunConfig
from runner.errors import ConfigError
from runner.integrations.spot import SpotRun
from runner.preemption.stop import StopController
from runner.storage.file import FileStorage
from tests.fixtures.ckpt import make_checkpoint


def _write(out: Path, step: int) -> Path:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.bin").write_bytes(bytes([step]) * 1000)
    (path / "state.json").write_text(f'{{"step": {step}}}')
    return path


def _run(tmp_path: Path, stop: StopController) -> SpotRun:
    spot = SpotRun(RunConfig(run_dir=tmp_path / "run"), integration="test", stop=stop)
    spot.attach()
    return spot


def test_a_stop_saves_that_step_and_exits_75_and_the_next_run_resumes_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stop = StopController()
    spot = _run(tmp_path, stop)
    assert spot.resume(out) is None
    assert spot.step_ended(1) == (False, False)
    stop.request_stop("SIGTERM")
    assert spot.step_ended(2) == (True, True)
    spot.saved(_write(out, 2), 2, final=False)
    assert spot.end(finished=False) == 75
    store = FileStorage(tmp_path / "run")
    manifest = verify_checkpoint(store, 2)
    assert manifest.format == "files"
    assert sorted(f.path for f in manifest.files) == [
        "checkpoint-2/model.bin",
        "checkpoint-2/state.json",
    ]

    fresh = tmp_path / "elsewhere"  # the trainer's files are gone: put back from the run dir
    again = _run(tmp_path, StopController())
    assert again.resume(fresh) == fresh / "checkpoint-2"
    assert (fresh / "checkpoint-2" / "model.bin").read_bytes() == bytes([2]) * 1000
    assert again.step_ended(3) == (False, False)
    assert again.end(finished=True) == 0


def test_a_stop_whose_checkpoint_was_never_written_exits_1(tmp_path: Path) -> None:
    stop = StopController()
    spot = _run(tmp_path, stop)
    spot.resume(tmp_path / "out")
    stop.request_stop("SIGTERM")
    assert spot.step_ended(4) == (True, True)
    assert spot.end(finished=False) == 1  # the trainer never saved step 4: not 75


def test_a_run_dir_of_another_kind_of_checkpoint_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "run", 5)  # a seed-bin checkpoint: `runner run`'s
    spot = _run(tmp_path, StopController())
    with pytest.raises(ConfigError, match="belongs to another job"):
        spot.resume(tmp_path / "out")
    spot.close()
