"""SavePolicy: every N steps, every T seconds, whichever first; injectable clock."""

from __future__ import annotations

import pytest

from runner.errors import ConfigError
from runner.preemption.policy import REASON_SECONDS, REASON_STEPS, SavePolicy


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_steps_cadence_lands_on_multiples() -> None:
    p = SavePolicy(every_steps=10, every_seconds=None, clock=FakeClock())
    due = [s for s in range(1, 36) if p.due(s)]
    assert due == [10, 20, 30]
    assert p.due(10) == REASON_STEPS


def test_out_of_cadence_save_keeps_alignment() -> None:
    p = SavePolicy(every_steps=10, every_seconds=None, clock=FakeClock())
    p.saved(13)  # e.g. SIGUSR1
    assert [s for s in range(14, 31) if p.due(s)] == [20, 30]


def test_seconds_cadence_restarts_at_every_save() -> None:
    clock = FakeClock()
    p = SavePolicy(every_steps=None, every_seconds=60.0, clock=clock)
    clock.now += 59.9
    assert p.due(1) is None
    clock.now += 0.1
    assert p.due(2) == REASON_SECONDS
    p.saved(2)
    clock.now += 30
    assert p.due(3) is None
    assert p.seconds_until_due() == pytest.approx(30.0)


def test_whichever_first() -> None:
    clock = FakeClock()
    p = SavePolicy(every_steps=100, every_seconds=10.0, clock=clock)
    clock.now += 11
    assert p.due(5) == REASON_SECONDS
    p.saved(5)
    assert p.due(100) == REASON_STEPS  # steps fire although only 0 s passed
    p.saved(100)
    assert p.due(100) is None  # the same state is never saved twice


def test_disabled_cadences_never_fire() -> None:
    clock = FakeClock()
    p = SavePolicy(every_steps=0, every_seconds=None, clock=clock)
    clock.now += 1e6
    assert [s for s in range(1, 500) if p.due(s)] == []
    assert p.seconds_until_due() is None


def test_resume_start_step_is_already_saved() -> None:
    p = SavePolicy(every_steps=10, every_seconds=None, clock=FakeClock(), start_step=30)
    assert p.due(30) is None
    assert p.due(40) == REASON_STEPS
    assert p.last_saved_step == 30


@pytest.mark.parametrize(("steps", "seconds"), [(-1, None), (None, 0.0), (None, -5.0)])
def test_bad_cadence_is_a_config_error(steps: int | None, seconds: float | None) -> None:
    with pytest.raises(ConfigError):
        SavePolicy(every_steps=steps, every_seconds=seconds)
