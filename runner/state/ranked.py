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
RANK_KEYS = ("rng", "sampler", "user")  # "user": only when the state has extras


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


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2's `fully_shard`): each rank then
    holds a shard, and the full state exists only once gathered (`full_tensor_state`)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def is_sharded_state(tensors: dict[str, Any]) -> bool:
    """Whether a `tensor_state` (or a host copy of one) holds DTensor shards."""
    return any(hasattr(t, "device_mesh") for t in tensors.get("model", {}).values())


def full_tensor_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The full (unsharded) model and optimizer state dicts, keyed by parameter name, on CPU.

    Collective for a sharded model: every rank of its group calls it at the same point. The
    gathered state lands on rank 0 only (cpu_offload); every other rank gets two empty dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def load_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
) -> None:
    """Load a whole state (`model.state_dict()`, `optimizer.state_dict()` of one process, as a
    whole-file checkpoint holds it) into a sharded model and its optimizer: each rank keeps its
    shard of every tensor. Collective; every rank passes the same full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=by_param_name(optimizer_state, model),
        options=StateDictOptions(full_state_dict=True),
    )


def by_param_name(optimizer_state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """`optimizer.state_dict()` (parameters by index) keyed by parameter name instead, the
    way `get_state_dict` keys it: index i is the i-th parameter of `model.named_parameters()`,
    the optimizer's order for the usual optimizer over `model.parameters()`."""
    names = [name for name, _ in model.named_parameters()]

    def name_of(index: Any) -> str:
        position = int(index)
        if not 0 <= position < len(names):
            raise ValueError(f"optimizer state of parameter {index}: the model has {len(names)}")
        return names[position]

    groups = [
        {**group, "params": [name_of(index) for index in group["params"]]}
        for group in optimizer_state.get("param_groups", [])
    ]
    state = {name_of(index): entry for index, entry in optimizer_state.get("state", {}).items()}
    return {"state": state, "param_groups": groups}


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
        own={
            "rank": rank,
            "world_size": world_size,
            **{key: payload[key] for key in RANK_KEYS if key in payload},
        },
        rank=rank,
        world_size=world_size,
    )
