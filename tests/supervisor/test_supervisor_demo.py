"""`runner demo` as the trainer of `runner run`: it knows it is supervised from RUNNER_ATTEMPT
(never empty there), also when the supervisor found no checkpoint to hand it and
RUNNER_RESUME_FROM is empty (click takes an empty variable for an unset one)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fixtures.demo_process import checkpoint_steps, demo_cmd

REPO = Path(__file__).resolve().parents[2]


def _corrupt_run(run_dir: Path) -> None:
    first = subprocess.run(
        demo_cmd(run_dir, steps=2, ckpt_every=2), cwd=REPO, capture_output=True, text=True
    )
    assert first.returncode == 0, first.stderr
    assert checkpoint_steps(run_dir) == [2]
    payload = run_dir / "checkpoints/step_000002/state.pt"
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x01
    payload.write_bytes(bytes(data))


def _demo(run_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RUNNER_")}
    return subprocess.run(
        demo_cmd(run_dir, "--fresh-start", steps=2, ckpt_every=2),
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_demo_with_the_supervisors_environment_and_no_resume_point_does_not_relog_refusals(
    tmp_path: Path,
) -> None:
    """The environment `runner run` gives its trainer when it found nothing to resume from
    (RUNNER_ATTEMPT=1, RUNNER_RESUME_FROM empty): the demo's own refusal of the corrupt
    checkpoint is at debug, the supervisor has logged it. The same demo unsupervised (no
    RUNNER_ATTEMPT) logs it as a warning."""
    supervised, alone = tmp_path / "supervised", tmp_path / "alone"
    _corrupt_run(supervised)
    shutil.copytree(supervised, alone)
    empty = {"RUNNER_RESUME_FROM": "", "RUNNER_RESUME_FORMAT": "", "RUNNER_RESUME_STEP": ""}
    under = _demo(supervised, {**empty, "RUNNER_ATTEMPT": "1"})
    assert under.returncode == 0, under.stderr
    assert "not resuming from step 2:" not in under.stdout + under.stderr, under.stderr
    plain = _demo(alone, empty)
    assert plain.returncode == 0, plain.stderr
    assert (plain.stdout + plain.stderr).count("not resuming from step 2:") == 1, plain.stderr
    # both set the corrupt checkpoint aside and trained step 2 again
    assert checkpoint_steps(supervised) == checkpoint_steps(alone) == [2]
