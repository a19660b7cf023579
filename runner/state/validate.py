"""The checks of a saved train state made before anything is loaded (runner.state.train_state):
a refused state leaves the model, optimizer and generators as they were."""

from __future__ import annotations

from typing import Any

import torch

from runner.errors import ConfigError, IntegrityError, SchemaError
from runner.state.counters import Counters
from runner.state.sampler import ResumableSampler

TRAIN_STATE_SCHEMA = "2"
_REQUIRED = ("model", "param_names", "optimizer", "counters")


def check_restorable(
    state: dict[str, Any],
    *,
    model: torch.nn.Module,
    sampler: ResumableSampler | None,
    world_size: int,
    restore_rng: bool,
) -> Counters:
    """The saved counters, once everything that can be checked without touching the live
    objects is: a refused state leaves the model, optimizer and generators as they were."""
    _check_layout(state)
    _check_param_names(state["param_names"], model)
    saved_counters = Counters.from_dict(state["counters"])
    if restore_rng and "rng" not in state:
        raise IntegrityError(
            "train state has no RNG section; it cannot be resumed bit-exactly "
            "(written by a tool that does not save RNG state?)"
        )
    if sampler is not None and sampler.world_size != world_size:
        raise ConfigError(
            f"sampler is sharded for world_size={sampler.world_size} but the resume is for "
            f"world_size={world_size}; build both from the same world size"
        )
    return saved_counters


def _check_layout(state: Any) -> None:
    if not isinstance(state, dict):
        raise IntegrityError(f"train state must be a dict, got {type(state).__name__}")
    schema = state.get("schema")
    if schema != TRAIN_STATE_SCHEMA:
        raise SchemaError(
            f"train state schema {schema!r} is not {TRAIN_STATE_SCHEMA!r}; "
            "migrate the checkpoint or use the runner version that wrote it"
        )
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        raise IntegrityError(f"train state lacks {missing}; the checkpoint is incomplete")


def _check_param_names(saved: Any, model: torch.nn.Module) -> None:
    if not saved:
        # Migrated from schema 1, which did not record names: the model's own order is
        # assumed (as schema 1 did), and load_state_dict(strict=True) still checks every key.
        return
    current = [name for name, _ in model.named_parameters()]
    if list(saved) != current:
        only_saved = sorted(set(saved) - set(current))[:5]
        only_here = sorted(set(current) - set(saved))[:5]
        raise ConfigError(
            "checkpoint was written for another model or parameter order "
            f"(only in checkpoint: {only_saved}, only in this model: {only_here}, "
            f"{len(saved)} vs {len(current)} parameters); resume with the same model code"
        )
