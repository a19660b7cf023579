"""The run's length: `--steps`, or a number of samples once several ranks (or a checkpoint
written at another world size) make steps of different sizes (runner.session.coordination
.target_samples)."""

from __future__ import annotations

import logging

from runner.checkpoint.manifest import Manifest
from runner.session.capture import TrainState
from runner.session.coordination import target_samples

# the session's lines keep one logger name (tests/e2e/test_readme_example.py pins it)
log = logging.getLogger("runner.session.train_session")


def global_batch(state: TrainState) -> int | None:
    """Samples one step consumes over every rank, when the state's sampler says."""
    sampler = getattr(state, "sampler", None)
    batch = getattr(sampler, "global_batch_size", None)
    return batch if isinstance(batch, int) and batch > 0 else None


def fixed_length(
    state: TrainState,
    *,
    steps: int | None,
    resumed: Manifest | None,
    in_samples: bool,
    announce: bool,
) -> int | None:
    """The run's length in samples when it matters (`in_samples`: several ranks now; or a
    checkpoint that carries one or was written at another world size), else None (--steps,
    as a single-process run always was). `announce`: say when the samples left are not a
    whole number of global batches."""
    carried = resumed is not None and "target_samples" in resumed.extra
    resized = resumed is not None and resumed.world_size != state.counters.world_size
    if not in_samples and not carried and not resized:
        return None
    batch = global_batch(state)
    length = target_samples(steps=steps, global_batch=batch, resumed=resumed)
    left = (length or 0) - (resumed.samples_seen if resumed else 0)
    if batch and left > 0 and left % batch and announce:
        log.warning(
            "the %d samples left of the run are not a whole number of global batches of "
            "%d at this world size: it ends %d samples past its length of %d",
            left,
            batch,
            batch - left % batch,
            length,
        )
    return length


def steps_of(length: int | None, state: TrainState, *, steps: int | None) -> int | None:
    """The step the run ends at, at this world size: `steps` unless its length in samples
    was fixed."""
    batch = global_batch(state)
    if length is not None and batch:
        return -(-length // batch)
    return steps


def carried_length(length: int | None, *, steps: int | None) -> dict[str, object] | None:
    """The manifest fields that carry the run's length in samples once it is fixed."""
    return {"target_samples": length, "target_steps": steps} if length else None
