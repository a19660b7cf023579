"""`runner run --adopt` around real frameworks from PyPI (a Hugging Face `Trainer` with a tiny
GPT-2 built in code, a Lightning module), mirrored to a real S3 server (SeaweedFS): SIGTERM
mid-run, the node's disk gone, the README's command on a new node resumes from the bucket and
ends with the weights of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from runner.checkpoint.listing import list_checkpoints
from runner.checkpoint.verify import verify_checkpoint
from runner.storage import open_storage
from tests.fixtures.supervised import REPO, Supervised

TRAINERS = REPO / "tests" / "trainers"
README = REPO / "README.md"


def _reference(tmp_path: Path, script: str, *args: str) -> str:
    """The final weights' sha256 of the same script run straight (this session, no runner)."""
    ref = tmp_path / "reference"
    ref.mkdir()
    subprocess.run(
        [sys.executable, str(TRAINERS / script), *args],
        cwd=ref,
        check=True,
        capture_output=True,
        timeout=180,
    )
    return next(ref.rglob("final.sha256")).read_text()


def _readme_command(pattern: str) -> list[str]:
    """The README's `runner run --adopt PATTERN ... -- python train.py` line, split."""
    section = README.read_text().split("## Your trainer's own checkpoints", 1)[1]
    lines = [line for line in section.splitlines() if f"--adopt '{pattern}'" in line]
    assert len(lines) == 1 and lines[0].startswith("runner run "), lines
    return shlex.split(lines[0])


def _stopped_then_resumed_elsewhere(
    tmp_path: Path, *, pattern: str, script: str, args: list[str], stop_after: str, mirror: str
) -> tuple[Supervised, Supervised, Path]:
    """The README's command for `pattern` (its bucket and `python train.py` swapped for the
    test's; a shorter quiet period and no restarts added). Node A: SIGTERM once the trainer
    printed `stop_after`; its disk is then deleted. Node B: the same command, to the end."""
    readme = _readme_command(pattern)
    split = readme.index("--")
    options = readme[2:split]
    options[options.index("--mirror") + 1] = mirror
    assert readme[split + 1 :] == ["python", "train.py"], readme
    command = [*options, "--adopt-quiet-seconds", "1", "--max-restarts", "0", "--"]
    command += [sys.executable, str(TRAINERS / script)]
    node_a, node_b = tmp_path / "node-a", tmp_path / "node-b"
    node_a.mkdir()
    node_b.mkdir()
    first = Supervised([*command, *args, "0.2"], cwd=node_a)
    first.expect(rf"^{stop_after}$", timeout=120)
    first.proc.send_signal(signal.SIGTERM)
    first.wait(60)
    shutil.rmtree(node_a)
    second = Supervised([*command, *args], cwd=node_b)
    second.wait(180)
    return first, second, node_b


def _standing(first: Supervised) -> int:
    stands = [line for line in first.stderr if "the checkpoint that stands is step" in line]
    assert len(stands) == 1, first.err
    return int(stands[0].split("the checkpoint that stands is step ")[1].split()[0])


def _all_verify(mirror: str) -> list[int]:
    store = open_storage(mirror)
    steps = list_checkpoints(store)
    for step in steps:
        assert verify_checkpoint(store, step).format == "files"
    return steps


def test_hf_trainer_resumes_from_the_bucket_bit_exactly(tmp_path: Path, s3_bucket: str) -> None:
    args = ["out", "40", "10"]  # max_steps 40 (an epoch is 32), save_steps 10
    reference = _reference(tmp_path, "hf_trainer.py", *args)
    mirror = f"s3://{s3_bucket}/hf"
    first, second, node_b = _stopped_then_resumed_elsewhere(
        tmp_path, pattern="out/checkpoint-*", script="hf_trainer.py", args=args,
        stop_after="step 23", mirror=mirror,
    )  # fmt: skip
    # HF dies of SIGTERM without a save of its own: what stands was written before the stop
    assert first.proc.returncode == 1, first.err
    standing = _standing(first)
    assert standing in (10, 20)
    assert second.proc.returncode == 0, second.err
    assert f"resume from {node_b / 'out' / f'checkpoint-{standing}'}" in second.out
    assert (node_b / "out" / "final.sha256").read_text() == reference
    assert _all_verify(mirror)[-1] == 40


def test_lightning_resumes_from_the_bucket(tmp_path: Path, s3_bucket: str) -> None:
    # an epoch is 8 batches and a checkpoint every 8 steps: Lightning restores no mid-epoch
    # data position, so only an epoch-aligned checkpoint can resume exactly
    args = ["ckpts", "40", "8"]
    reference = _reference(tmp_path, "lightning_trainer.py", *args)
    mirror = f"s3://{s3_bucket}/pl"
    first, second, node_b = _stopped_then_resumed_elsewhere(
        tmp_path, pattern="ckpts/*.ckpt", script="lightning_trainer.py", args=args,
        stop_after="step 19", mirror=mirror,
    )  # fmt: skip
    # Lightning turns SIGTERM into an exit of its own without saving: not 75
    assert first.proc.returncode == 1, first.err
    standing = _standing(first)
    assert standing in (8, 16)
    assert second.proc.returncode == 0, second.err
    restored = node_b / "ckpts" / f"step={standing}.ckpt"
    assert f"resume from {restored}" in second.out
    assert (node_b / "final.sha256").read_text() == reference
    assert _all_verify(mirror)[-1] == 40
