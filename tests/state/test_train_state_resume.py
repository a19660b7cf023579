"""Bit-exact resume.

60 steps straight vs. 30 steps, a committed checkpoint (CheckpointWriter), and the remaining 30
in another process that loads it verified and weights-only: identical fingerprints and loss
histories, with shuffled data, dropout and a warmup+cosine LR schedule. Epochs are 7 batches
long, so step 30 is in the middle of epoch 4 and step 28 is an epoch boundary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from runner.checkpoint.writer import CheckpointMeta, CheckpointWriter
from runner.demo.components import DemoComponents, build_demo

STEPS = 60
SETTINGS = {"seed": 7, "device": "cpu", "batch_size": 8, "total_steps": STEPS}
OVERRIDES = {"max_samples": 56}  # 56 windows / 8 = 7 batches per epoch

# Runs in a fresh interpreter: loads the checkpoint weights-only, resumes, prints the outcome.
RESUME_SCRIPT = """
import json, sys, torch
from runner.demo.components import build_demo
torch.set_num_threads(int(sys.argv[2]))
demo = build_demo(**json.loads(sys.argv[3]))
from pathlib import Path
from runner.checkpoint.load import load_state
state = load_state(Path(sys.argv[1]))  # sha256-verified, then torch.load(weights_only=True)
counters = demo.restore(state)
restored = [counters.step, counters.epoch, counters.batch_in_epoch, counters.samples_seen]
restored_print = demo.fingerprint()
while not demo.done:
    demo.train_step()
print(json.dumps({
    "restored": restored,
    "restored_fingerprint": restored_print,
    "fingerprint": demo.fingerprint(),
    "losses": demo.loss_history,
}))
"""


def _demo() -> DemoComponents:
    return build_demo(**SETTINGS, **OVERRIDES)


def _run_to(demo: DemoComponents, step: int) -> None:
    while demo.counters.step < step:
        demo.train_step()


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Both sides of the comparison use one intra-op thread: it is the fastest setting on a
    # shared 2-core machine, and the subprocess is told to use the same.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def straight(one_thread: None) -> DemoComponents:
    demo = _demo()
    _run_to(demo, STEPS)
    return demo


def _resume_in_subprocess(checkpoint: Path) -> dict:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            RESUME_SCRIPT,
            str(checkpoint),
            str(torch.get_num_threads()),
            json.dumps({**SETTINGS, **OVERRIDES}),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop_at", "epoch", "batch_in_epoch"),
    [(30, 4, 2), (28, 4, 0)],
    ids=["mid-epoch", "epoch-boundary"],
)
def test_resume_in_another_process_is_bit_exact(
    tmp_path: Path, straight: DemoComponents, stop_at: int, epoch: int, batch_in_epoch: int
) -> None:
    first = _demo()
    _run_to(first, stop_at)
    assert (first.counters.epoch, first.counters.batch_in_epoch) == (epoch, batch_in_epoch)
    stopped_print = first.fingerprint()
    committed = CheckpointWriter(tmp_path, run_id="resume-test", writer_id="pytest").write_state(
        first.capture(),
        meta=CheckpointMeta(
            step=stop_at,
            samples_seen=first.counters.samples_seen,
            world_size=1,
            epoch=epoch,
            batch_in_epoch=batch_in_epoch,
            fingerprint=stopped_print,
        ),
    )

    resumed = _resume_in_subprocess(committed.path)

    assert resumed["restored"] == [stop_at, epoch, batch_in_epoch, stop_at * 8]
    assert resumed["restored_fingerprint"] == stopped_print
    assert resumed["fingerprint"] == straight.fingerprint()
    # json round-trips floats exactly (repr), so this is bit-for-bit equality of every loss.
    assert resumed["losses"] == straight.loss_history
    assert len(resumed["losses"]) == STEPS


def test_the_run_is_not_trivially_reproducible(straight: DemoComponents) -> None:
    """The bit-exact test means something only if data, dropout and LR all vary."""
    orders = {tuple(straight.sampler.epoch_order(e).tolist()) for e in range(3)}
    assert len(orders) == 3
    assert straight.config.dropout > 0
    lrs = [straight.scheduler.lr_lambdas[0](s) for s in (0, 10, 30, 59)]
    assert len(set(lrs)) == 4
    demo = _demo()
    demo.model.train()
    inputs, _ = demo.next_batch()
    assert not torch.equal(demo.model(inputs), demo.model(inputs))  # dropout draws differ
