"""The Lightning callback never lets Lightning's SIGTERMException (a SystemExit with code None,
raised when a SIGTERM lands before the callback took the handler back) end the run with 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from runner.config import RunConfig
from runner.integrations.lightning import SpotRunnerCallback
from runner.preemption.stop import StopController


def test_sigterm_exception_becomes_exit_1(tmp_path: Path) -> None:
    spot = SpotRunnerCallback(RunConfig(run_dir=tmp_path / "run"), stop=StopController())
    with pytest.raises(SystemExit) as raised:
        spot.on_exception(None, None, SIGTERMException())  # type: ignore[arg-type]
    assert raised.value.code == 1
    assert spot.exit_code == 1


def test_another_exception_is_left_to_propagate(tmp_path: Path) -> None:
    spot = SpotRunnerCallback(RunConfig(run_dir=tmp_path / "run"), stop=StopController())
    spot.on_exception(None, None, ValueError("user bug"))  # type: ignore[arg-type]
    assert spot.spot.exit_code is None
    spot.spot.close()
