"""Resume at another world size under real torchrun: 2 ranks -> 1 and 1 -> 2.

Each test stops a run with SIGTERM at a random step N (so N is no multiple of anything
convenient), re-runs the same command at the other world size, and proves:
- samples_seen continues exactly: the checkpoint at N holds N x its global batch, and every
  checkpoint of the resumed run holds N's plus its own steps x its global batch;
- the step is rescaled: the resumed run logs "step rescaled N -> N x old / new" (floor) and
  goes on counting from there;
- the run ends at the samples_seen of a run that never changed size (the straight run's);
- with --sample-log, every step of both attempts consumed the exact next slice of epoch 0's
  order (ResumableSampler(len(dataset), batch_size=4, seed=0).epoch_order(0)): every index is
  consumed exactly once across the attempts and together they are that order's prefix.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runner.demo.components import build_demo
from runner.state.sampler import ResumableSampler
from tests.fixtures.demo_process import checkpoint_steps, logged_steps, manifest
from tests.fixtures.multirank import (
    BATCH,
    STEPS,
    Plain,
    Straight,
    demo_args,
    final_fingerprint,
    rank_exits,
    sample_lines,
    start_plain,
    wait_until,
)
from tests.fixtures.torchrun import Torchrun

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def order() -> list[int]:
    """Epoch 0's order of the demo dataset (the demo's seed 0, the tests' batch size)."""
    dataset = build_demo(seed=0, device="cpu", batch_size=BATCH, total_steps=STEPS).dataset
    return ResumableSampler(len(dataset), batch_size=BATCH, seed=0).epoch_order(0).tolist()


@pytest.fixture(scope="module")
def straight_1rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """The last manifest of one plain (1-rank) run of `demo_args` to the end."""
    base = tmp_path_factory.mktemp("straight-1rank")
    launch = start_plain(base / "run", log=base / "out.log")
    try:
        assert launch.wait(180) == 0, launch.output()
        yield manifest(base / "run", STEPS)
    finally:
        if launch.proc.poll() is None:
            launch.proc.kill()
            launch.proc.wait(30)


def stop_at_random_step(
    run_dir: Path, running: Callable[[], bool], stop: Callable[[], None], *, low: int = 11
) -> int:
    """SIGTERM (`stop`) once the run logged a random step past `low`; returns that step."""
    # its own generator: building the demo (the `order` fixture) seeds the global one
    at = random.Random().randint(low, STEPS - 15)
    wait_until(lambda: max(logged_steps(run_dir), default=0) >= at, running, f"step {at}")
    stop()
    return at


def consumed(
    lines: list[dict[str, object]], upto: int | None = None
) -> dict[tuple[int, int], list[int]]:
    """(step, rank) -> indices of --sample-log lines (steps <= `upto` when given), each once."""
    found: dict[tuple[int, int], list[int]] = {}
    for line in lines:
        step, rank = int(line["step"]), int(line["rank"])  # type: ignore[call-overload]
        if upto is not None and step > upto:
            continue
        assert line["epoch"] == 0 and (step, rank) not in found, line
        found[(step, rank)] = list(line["indices"])  # type: ignore[call-overload]
    return found


def both_ranks(samples: Path, upto: int | None = None) -> dict[tuple[int, int], list[int]]:
    """`consumed` of a 2-rank attempt: its FILE.rank0 and FILE.rank1 together."""
    ranks = [sample_lines(samples.with_name(f"{samples.name}.rank{rank}")) for rank in (0, 1)]
    return {**consumed(ranks[0], upto), **consumed(ranks[1], upto)}


def expected_slices(
    order: list[int], *, first_step: int, last_step: int, ranks: int, offset: int
) -> dict[tuple[int, int], list[int]]:
    """What steps first_step..last_step on `ranks` ranks take, starting `offset` samples in."""
    slices = {}
    for i, step in enumerate(range(first_step, last_step + 1)):
        for rank in range(ranks):
            start = offset + (i * ranks + rank) * BATCH
            slices[(step, rank)] = order[start : start + BATCH]
    return slices


def assert_each_consumed_once(
    order: list[int], *attempts: dict[tuple[int, int], list[int]], total: int
) -> None:
    every = [index for attempt in attempts for batch in attempt.values() for index in batch]
    assert len(every) == len(set(every)) == total
    assert set(every) == set(order[:total])


def test_two_ranks_resumed_at_one(
    torchrun: Callable[..., Torchrun],
    plain_demo: Callable[..., Plain],
    tmp_path: Path,
    order: list[int],
    straight_2rank: Straight,
) -> None:
    run_dir, samples = tmp_path / "run", tmp_path / "samples.jsonl"
    command = ("--sample-log", str(samples))
    first = torchrun(2, demo_args(run_dir, *command))
    stop_at_random_step(
        run_dir, lambda: first.proc.poll() is None, lambda: first.signal(signal.SIGTERM)
    )
    assert first.wait(90) == 1, first.output()  # torchrun's agent, after a forwarded SIGTERM
    assert rank_exits(first) == {0: 75, 1: 75}, first.output()
    stopped = checkpoint_steps(run_dir)[-1]
    saved = manifest(run_dir, stopped)
    assert (saved["world_size"], saved["samples_seen"]) == (2, stopped * 2 * BATCH)

    again = plain_demo(run_dir, *command)
    assert again.wait(180) == 0, again.output()
    out = again.output()
    assert f"world size changed 2 -> 1: step rescaled {stopped} -> {2 * stopped} " in out
    assert "run length fixed in samples (480)" in out
    end = 2 * STEPS  # 480 samples at 4 a step
    final = manifest(run_dir, end)
    assert final["samples_seen"] == straight_2rank.manifest["samples_seen"] == 480
    for step in checkpoint_steps(run_dir):
        if step > stopped:
            resumed = manifest(run_dir, step)
            assert (resumed["world_size"], resumed["samples_seen"]) == (1, step * BATCH), step
    assert sorted(logged_steps(run_dir))[-1] == end

    before = both_ranks(samples, stopped)
    after = consumed(sample_lines(samples))
    assert before == expected_slices(order, first_step=1, last_step=stopped, ranks=2, offset=0)
    assert after == expected_slices(
        order, first_step=2 * stopped + 1, last_step=end, ranks=1, offset=stopped * 2 * BATCH
    )
    assert_each_consumed_once(order, before, after, total=480)


def test_one_rank_resumed_at_two(
    torchrun: Callable[..., Torchrun],
    plain_demo: Callable[..., Plain],
    tmp_path: Path,
    order: list[int],
    straight_1rank: dict[str, object],
) -> None:
    run_dir, samples = tmp_path / "run", tmp_path / "samples.jsonl"
    command = ("--sample-log", str(samples))
    first = plain_demo(run_dir, *command)
    # past step 30: the 1-rank checkpoints numbered above the rescaled step (its 30 at least)
    # are the older lineage that the resumed run must re-base past
    stop_at_random_step(
        run_dir,
        lambda: first.proc.poll() is None,
        lambda: first.proc.send_signal(signal.SIGTERM),
        low=31,
    )
    assert first.wait(90) == 75, first.output()
    stopped = checkpoint_steps(run_dir)[-1]
    saved = manifest(run_dir, stopped)
    assert (saved["world_size"], saved["samples_seen"]) == (1, stopped * BATCH)

    again = torchrun(2, demo_args(run_dir, *command))
    assert again.wait(180) == 0, again.output()
    assert rank_exits(again) == {0: 0, 1: 0}, again.output()
    out = again.rank_stderr(0)
    rescaled = stopped // 2
    assert f"world size changed 1 -> 2: step rescaled {stopped} -> {rescaled} " in out
    assert f"re-basing the run at step {rescaled} before training" in out
    total = STEPS * BATCH
    assert f"run length fixed in samples ({total})" in out
    last, fingerprint = final_fingerprint(out)
    final = manifest(run_dir, last)
    ended = int(final["samples_seen"])  # type: ignore[call-overload]
    assert (final["world_size"], final["fingerprint"]) == (2, fingerprint)
    for step in checkpoint_steps(run_dir):
        if step >= rescaled:  # nothing of the 1-rank lineage is numbered above the new step
            resumed = manifest(run_dir, step)
            assert (resumed["world_size"], resumed["samples_seen"]) == (
                2,
                stopped * BATCH + (step - rescaled) * 2 * BATCH,
            ), step

    before = consumed(sample_lines(samples), stopped)
    after = both_ranks(samples)
    assert before == expected_slices(order, first_step=1, last_step=stopped, ranks=1, offset=0)
    assert after == expected_slices(
        order, first_step=rescaled + 1, last_step=last, ranks=2, offset=stopped * BATCH
    )
    assert_each_consumed_once(order, before, after, total=ended)

    # the finished run is the newest: the same command once more trains nothing
    done = torchrun(2, demo_args(run_dir, *command))
    assert done.wait(180) == 0, done.output()
    assert f"resuming from local checkpoint step {last}" in done.rank_stderr(0)
    assert final_fingerprint(done.rank_stderr(0)) == (last, fingerprint)

    # The end in samples. An odd N leaves 4 samples, half a global batch of 2 ranks: whole
    # batches cannot end on the length, so the run trains one more and says so when it
    # resumes (docs/distributed.md, "Resume at another world size"); an even N ends on it.
    if stopped % 2:
        assert ended == total + BATCH
        assert f"it ends {BATCH} samples past its length of {total}" in out
        return
    assert ended == straight_1rank["samples_seen"] == total
