"""The run's length in samples (runner.session.coordination.target_samples): fixed when the
run starts, carried by its checkpoints, recomputed when a later attempt asks for another
--steps. Real manifests, no processes."""

from __future__ import annotations

import logging

import pytest

from runner.checkpoint.manifest import FORMAT_DCP, Manifest, schema_for
from runner.session.coordination import target_samples


def _manifest(*, step: int, samples: int, world_size: int, extra: dict[str, object]) -> Manifest:
    return Manifest(
        schema=schema_for(FORMAT_DCP),
        step=step,
        samples_seen=samples,
        world_size=world_size,
        run_id="r" * 16,
        writer="test",
        format=FORMAT_DCP,
        fingerprint="",
        extra=extra,
    )


def test_a_new_run_fixes_its_length_from_steps_and_its_global_batch() -> None:
    assert target_samples(steps=60, global_batch=8, resumed=None) == 480
    assert target_samples(steps=None, global_batch=8, resumed=None) is None
    assert target_samples(steps=60, global_batch=None, resumed=None) is None


def test_the_length_a_checkpoint_carries_wins_at_any_world_size() -> None:
    # started at 2 ranks x 4 (60 steps = 480 samples), resumed at 1 rank: still 480
    carried = _manifest(
        step=10, samples=80, world_size=2, extra={"target_samples": 480, "target_steps": 60}
    )
    assert target_samples(steps=60, global_batch=4, resumed=carried) == 480


def test_an_older_checkpoint_without_one_gives_steps_times_its_own_samples_per_step() -> None:
    older = _manifest(step=10, samples=80, world_size=2, extra={})
    assert target_samples(steps=60, global_batch=4, resumed=older) == 480


def test_another_steps_on_a_later_attempt_changes_the_length_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    carried = _manifest(
        step=10, samples=80, world_size=2, extra={"target_samples": 480, "target_steps": 60}
    )
    with caplog.at_level(logging.WARNING):
        assert target_samples(steps=90, global_batch=4, resumed=carried) == 720
    assert "--steps 90, not 60 as when the run's length was fixed" in caplog.text
    assert "its length is now 720 samples (was 480)" in caplog.text
