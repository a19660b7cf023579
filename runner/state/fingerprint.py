"""One sha256 that names a training state: equal fingerprints mean bit-identical states.

Canonical order (version tag ``spot-runner-fingerprint/1``):

1. the model's ``state_dict()`` entries sorted by name (parameters and persistent buffers);
2. the optimizer's ``state_dict()["state"]`` sorted by parameter index (the index is the
   parameter's position in the optimizer's param groups, which is ``model.parameters()`` order
   for the usual ``AdamW(model.parameters())``), and inside each entry the keys sorted by name
   (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``).

Each entry contributes a header ``section NUL key NUL dtype NUL shape NUL nbytes NUL`` and then the
tensor's raw bytes, so two states that differ only in dtype, shape or naming never collide.
Non-tensor values (a float ``step`` in some optimizers) contribute their type and ``repr``.
Hyperparameters (``param_groups``: lr, betas, ...) are not tensors of the state and are left
out: a state converted from the seed ``.bin`` format, which carries none, fingerprints the same.

A model sharded across ranks (FSDP2) is fingerprinted by `full_fingerprint`: the same
digest, of its gathered full state.

The digest depends only on values, never on memory addresses or process, so fingerprints can be
compared across processes, machines and devices (tensors are hashed from their CPU copy).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

FINGERPRINT_VERSION = b"spot-runner-fingerprint/1\0"


def fingerprint(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    user: Mapping[str, Any] | None = None,
) -> str:
    """sha256 (hex) of the model and optimizer tensors in canonical order, then the user's
    own state when there is any (runner.state.user)."""
    return fingerprint_state(
        model.state_dict(), None if optimizer is None else optimizer.state_dict(), user=user
    )


def full_fingerprint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, primary: bool = True
) -> str:
    """`fingerprint` of the full (unsharded) state, on the `primary` rank; "" on the others.

    A model sharded by FSDP2 (DTensor parameters) is gathered first, which is collective:
    every rank of its group calls this at the same point, and rank 0, where the gathered state
    lands, hashes it (the primary is rank 0). A model that is whole on every rank (one process,
    DDP) is hashed by the primary alone: the others skip the work. Equal values give the digest
    of `fingerprint` at any world size and sharding."""
    from runner.state.ranked import is_sharded

    if not is_sharded(model):
        return fingerprint(model, optimizer) if primary else ""
    gathered = gather_full(model, optimizer, primary=primary)
    return fingerprint_tensors(gathered) if gathered is not None else ""


def gather_full(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, primary: bool = True
) -> dict[str, Any] | None:
    """The full state of a sharded model, gathered to CPU (collective: every rank calls it),
    as `{"model": ..., "optimizer": ...}` on the primary (rank 0), None on the others: what
    `fingerprint_tensors` hashes, later if need be (the gathered tensors are copies)."""
    from runner.state.ranked import full_tensor_state

    model_state, optimizer_state = full_tensor_state(model, optimizer)
    if not primary:
        return None
    if not model_state:
        raise RuntimeError("full_fingerprint: the gathered state is on rank 0, not this primary")
    return {"model": model_state, "optimizer": optimizer_state}


def fingerprint_tensors(tensors: Mapping[str, Any]) -> str:
    """`fingerprint` of a whole (unsharded) `runner.state.ranked.tensor_state`, or of a host
    copy of one: parameters by name, as get_state_dict keys them."""
    return fingerprint_state(tensors["model"], by_param_index(tensors["optimizer"]))


def by_param_index(optimizer_state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (`get_state_dict`'s) keyed by index
    instead, as `optimizer.state_dict()` keys it: a parameter's position across the param
    groups, whose "params" list the names in the optimizer's order (for the usual optimizer
    over `model.parameters()`, the `model.named_parameters()` order)."""
    index: dict[str, int] = {}
    groups = []
    for group in optimizer_state.get("param_groups", []):
        first = len(index)
        for name in group["params"]:
            if name in index:
                raise ValueError(f"parameter {name!r} is in two param groups")
            index[name] = len(index)
        groups.append({**group, "params": list(range(first, len(index)))})
    per_param: Mapping[str, Any] = optimizer_state.get("state", {})
    unknown = sorted(set(per_param) - set(index))
    if unknown:
        raise ValueError(f"optimizer state of {unknown} that no param group lists")
    return {"state": {index[name]: per_param[name] for name in per_param}, "param_groups": groups}


def fingerprint_state(
    model_state: Mapping[str, Any],
    optimizer_state: Mapping[str, Any] | None,
    *,
    user: Mapping[str, Any] | None = None,
) -> str:
    """Same digest as `fingerprint`, from state dicts (e.g. a checkpoint loaded from disk).
    `user`: the saved user state, its leaves by dotted path in section `user` (none: the
    digest of model and optimizer alone, as before extras existed)."""
    if "param_groups" in model_state:
        # Swapped arguments would silently give another digest: refuse the likely mix-up.
        raise TypeError("fingerprint_state: model_state looks like an optimizer state_dict")
    digest = hashlib.sha256(FINGERPRINT_VERSION)
    for name in sorted(model_state):
        _update(digest, "model", name, model_state[name])
    if optimizer_state is not None:
        per_param: Mapping[Any, Mapping[str, Any]] = optimizer_state.get("state", {})
        for index in sorted(per_param, key=_index_key):
            entry = per_param[index]
            for key in sorted(entry):
                _update(digest, "optimizer", f"{index}.{key}", entry[key])
    if user:
        from runner.state.user import flatten_tensors

        flat = flatten_tensors(user)
        for path in sorted(flat):
            _update(digest, "user", path, flat[path])
    return digest.hexdigest()


def fingerprint_payload(payload: Mapping[str, Any]) -> str:
    """Same digest as `fingerprint`, from a train-state payload (`ModuleTrainState.capture()`,
    whose "model" and "optimizer" are the two state dicts): the fingerprint of what is saved."""
    return fingerprint_state(payload["model"], payload.get("optimizer"), user=payload.get("user"))


def _index_key(index: Any) -> tuple[int, str]:
    # torch uses int indices; a state dict rebuilt from JSON may carry them as strings.
    return (int(index), "") if str(index).isdigit() else (1 << 62, str(index))


def _update(digest: Any, section: str, key: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensor = tensor.contiguous()
        header = f"{section}\0{key}\0{tensor.dtype}\0{tuple(tensor.shape)}\0{tensor.nbytes}\0"
        digest.update(header.encode())
        if tensor.numel():
            # A uint8 view of the storage: no copy for a contiguous CPU tensor, any dtype
            # (bfloat16 included, which numpy cannot represent).
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    else:
        digest.update(f"{section}\0{key}\0{type(value).__name__}\0{value!r}\0".encode())
