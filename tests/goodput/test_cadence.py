"""`--ckpt-every-seconds auto`: Young's √(2·C·M) from measured steps and failures."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from runner.cli.options import config_from_options
from runner.errors import ConfigError
from runner.goodput.cadence import AutoCadence, observed_mtbf, young_interval
from tests.fixtures.demo_process import run_demo


def test_the_interval_is_youngs_from_the_stall_and_the_slower_steps() -> None:
    cadence = AutoCadence(mtbf_prior=3600.0)
    for _ in range(20):
        cadence.step(0.10, saving=False)
    for _ in range(10):  # a background save in flight: 20 ms slower each
        cadence.step(0.12, saving=True)
    choice = cadence.checkpointed(stall=0.05, background=0.9, seconds_run=0.0, failures=0)
    assert choice.slowdown == pytest.approx(10 * 0.02)
    assert choice.cost == pytest.approx(0.25)
    assert choice.interval == pytest.approx(math.sqrt(2 * 0.25 * 3600.0))
    assert cadence.interval == choice.interval


def test_failures_without_notice_shorten_it_and_one_save_is_the_floor() -> None:
    assert observed_mtbf(3600.0, seconds_run=7200.0, failures=2) == pytest.approx(3600.0)
    assert observed_mtbf(3600.0, seconds_run=7200.0, failures=0) == pytest.approx(10800.0)
    cadence = AutoCadence(mtbf_prior=10.0)
    choice = cadence.checkpointed(stall=0.01, background=4.0, seconds_run=0.0, failures=0)
    assert young_interval(0.01, 10.0) < 4.0
    assert choice.interval == 4.0  # never a save started while the last one persists


def test_auto_is_an_option_value_and_refused_with_a_number() -> None:
    config = config_from_options(run_dir="r", ckpt_every_seconds="auto", mtbf=600.0)
    assert config.ckpt_every_seconds_auto and config.ckpt_every_seconds is None
    assert config.mtbf == 600.0
    with pytest.raises(ConfigError, match="either auto or a number"):
        config_from_options(run_dir="r", ckpt_every_seconds=5.0, ckpt_every_seconds_auto=True)


def _seconds_saves(run_dir: Path) -> list[dict[str, object]]:
    (record,) = (run_dir / "attempts").glob("*.jsonl")
    events = [json.loads(line) for line in record.read_text().splitlines()]
    return [e for e in events if e["event"] == "checkpoint" and e["reason"] == "seconds"]


@pytest.mark.slow
def test_the_demo_saves_by_the_interval_auto_chose(tmp_path: Path) -> None:
    """A short prior MTBF makes auto save at its floor (1 s) through a 3-second run; a long one
    (√(2·C·M) in minutes) saves only at the end: the cadence follows the choice."""
    often, rarely = tmp_path / "often", tmp_path / "rarely"
    for run_dir, mtbf in ((often, "0.5"), (rarely, "1000000")):
        done = run_demo(
            run_dir, "--ckpt-every-seconds", "auto", "--mtbf", mtbf, steps=150, ckpt_every=0
        )
        assert done.returncode == 0, done.stderr
        assert "checkpoint interval" in done.stderr and "(auto" in done.stderr
    saves = _seconds_saves(often)
    assert len(saves) >= 2, saves
    times = [float(e["t"]) for e in saves]  # type: ignore[arg-type]
    assert all(b - a >= 0.9 for a, b in itertools.pairwise(times)), times
    assert _seconds_saves(rarely) == []
