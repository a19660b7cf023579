"""The train state split the way a multi-rank checkpoint (format `torch-dcp`) stores it.

    tensors   {"model": ..., "optimizer": ...}: the state dicts of
              torch.distributed.checkpoint.state_dict.get_state_dict (parameter names as
              keys), written by DCP across the ranks and resharded by it on load
    shared    what every rank holds alike: schema, param_names, scheduler, counters,
              loss_history, extra (written once, by global rank 0)
    per rank  each rank's own: its RNG and its sampler position (one file per rank)

A state captured this way and loaded back is the same state `capture`/`restore` would give:
the checks, the sampler's position (counted in samples, so exact at any world size), the RNG
and the world-size rescale are those of runner.state.train_state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SHARED_KEYS = ("schema", "param_names", "scheduler", "counters", "loss_history", "extra")
RANK_KEYS = ("rng", "sampler")


@dataclass(frozen=True, kw_only=True)
class RankedPayload:
    """One rank's part of a multi-rank checkpoint, as captured at a step boundary."""

    tensors: dict[str, Any]
    shared: dict[str, Any]
    own: dict[str, Any]
    rank: int
    world_size: int


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state dicts keyed by parameter name, the live tensors
    (DCP loads into them in place). An optimizer that has not stepped gets its state
    created first (zeros, as before its first step), so a load has tensors to fill."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def load_tensor_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]
) -> None:
    """Put a loaded `tensor_state` into the live model and optimizer (param groups too)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optimizer"],
    )


def split_payload(
    payload: dict[str, Any], tensors: dict[str, Any], *, rank: int, world_size: int
) -> RankedPayload:
    """A `capture()` payload's non-tensor parts, beside the tensors DCP writes."""
    return RankedPayload(
        tensors=tensors,
        shared={key: payload[key] for key in SHARED_KEYS},
        own={"rank": rank, "world_size": world_size, **{key: payload[key] for key in RANK_KEYS}},
        rank=rank,
        world_size=world_size,
    )
