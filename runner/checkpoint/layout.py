"""Names inside a run directory and a mirror prefix (DESIGN.md, 'Run directory').

Keys are '/'-separated and relative to the location root, so the same names serve a local
run dir and an object-store prefix.
"""

from __future__ import annotations

import re

from runner.atomicity.temp import TMP_PREFIX

__all__ = ["TMP_PREFIX"]  # re-exported: the run dir's temp names (runner.atomicity.temp)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST_NAME = "manifest.json"
LOSS_FILE = "loss.jsonl"
# one file of events per attempt (runner.goodput.records), mirrored under the same name
ATTEMPTS_DIR = "attempts"
# The manifest field naming a mirror upload's attempt directory (runner.mirror.remote_layout):
# defined here so that readers below the mirror layer can strip it.
ATTEMPT_FIELD = "mirror_attempt"
SAMPLES_FILE = "samples.json"
STATE_FILE = "state.json"

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_SEED_BIN = re.compile(r"^step_(\d{6,})\.bin$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


def seed_bin_name(step: int) -> str:
    return f"{step_dir_name(step)}.bin"


def parse_step_dir(name: str) -> int | None:
    """Step number of a committed-checkpoint directory name, or None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def parse_seed_bin(name: str) -> int | None:
    m = _SEED_BIN.match(name)
    return int(m.group(1)) if m else None


def checkpoint_key(step: int) -> str:
    """Key of a checkpoint directory relative to the location root."""
    return f"{CHECKPOINTS_DIR}/{step_dir_name(step)}"


def manifest_key(step: int) -> str:
    return f"{checkpoint_key(step)}/{MANIFEST_NAME}"
