"""The user's own state in a checkpoint: `ModuleTrainState(..., extra={name: obj})`.

What an exact resume needs beyond model, optimizer, scheduler, sampler and the global RNGs:
an EMA of the weights, a GradScaler, a `torch.Generator` of the data pipeline, a batch fetched
ahead of the step that uses it. Each named object is one of

- anything with `state_dict()` / `load_state_dict()` (a module, a GradScaler, your class);
- a `torch.Generator` (its state, a byte tensor);
- a `torch.Tensor`, restored in place (same shape and dtype);
- a `dict` (tensors and plain data), restored in place: cleared and filled again, so a loop
  that reads its prefetched batch from `holder["x"]` gets the saved one.

Saved under the payload's `"user"` key ({name: value}); in a multi-rank checkpoint each rank
keeps its own (a prefetched batch differs per rank). Its tensors count in a single process's
fingerprint (after the model and optimizer, section `user`; a state without extras keeps the
digest it always had).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from runner.errors import ConfigError

log = logging.getLogger(__name__)

USER_KEY = "user"


def check_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` as a dict, or ConfigError naming the first entry it cannot save."""
    if not isinstance(extra, Mapping):
        raise ConfigError(f"extra must be a dict of name -> object, got {type(extra).__name__}")
    for name, obj in extra.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"extra: names are non-empty strings, got {name!r}")
        if not _supported(obj):
            raise ConfigError(
                f"extra[{name!r}] is a {type(obj).__name__}: give an object with state_dict() "
                "and load_state_dict(), a torch.Generator, a tensor, or a dict (updated in "
                "place on resume)"
            )
    return dict(extra)


def _supported(obj: Any) -> bool:
    stateful = callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )
    return stateful or isinstance(obj, torch.Generator | torch.Tensor | dict)


def capture_user(extra: Mapping[str, Any]) -> dict[str, Any]:
    """{name: its saved form}: live tensors (the caller copies them when it must)."""
    saved: dict[str, Any] = {}
    for name, obj in extra.items():
        if isinstance(obj, torch.Generator):
            saved[name] = obj.get_state()
        elif isinstance(obj, torch.Tensor):
            saved[name] = obj.detach()
        elif isinstance(obj, dict):
            saved[name] = dict(obj)
        else:
            saved[name] = obj.state_dict()
    return saved


def check_user(saved: Any, extra: Mapping[str, Any]) -> None:
    """Before anything is loaded: a tensor must fit the live one it is copied into."""
    if not extra:
        return
    if not isinstance(saved, dict):
        return  # a checkpoint from before extras: restore_user says what is missing
    for name, obj in extra.items():
        value = saved.get(name)
        if isinstance(obj, torch.Tensor) and value is not None and not _fits(value, obj):
            raise ConfigError(
                f"extra[{name!r}]: the checkpoint holds {_describe(value)}, the live tensor is "
                f"{_describe(obj)}; give a tensor of the saved shape and dtype, or a dict to "
                "have it replaced"
            )


def _fits(value: Any, live: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and (value.shape, value.dtype) == (
        live.shape,
        live.dtype,
    )


def restore_user(saved: Any, extra: Mapping[str, Any], *, step: int) -> None:
    """Load each saved entry into its live object; an entry on one side only is named."""
    saved = saved if isinstance(saved, dict) else {}
    for name, obj in extra.items():
        if name not in saved:
            log.warning(
                "the checkpoint of step %d holds no extra[%r]: it keeps its current value, "
                "so this resume is not exact",
                step,
                name,
            )
            continue
        value = saved[name]
        try:
            if isinstance(obj, torch.Generator):
                obj.set_state(value)
            elif isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.copy_(value)
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(value)
            else:
                obj.load_state_dict(value)
        except (RuntimeError, TypeError, ValueError, KeyError) as exc:
            why = f"extra[{name!r}] does not load the checkpoint's state: {exc}"
            raise ConfigError(why) from exc
    unknown = sorted(set(saved) - set(extra))
    if unknown:
        log.warning(
            "the checkpoint of step %d holds extra %s that this run does not pass: not restored",
            step,
            ", ".join(repr(n) for n in unknown),
        )


def flatten_tensors(saved: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`saved` flattened to {"name.key...": leaf} for the fingerprint (sorted by the caller)."""
    flat: dict[str, Any] = {}
    for key, value in saved.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_tensors(value, prefix=f"{path}."))
        elif isinstance(value, list | tuple):
            items = {str(i): item for i, item in enumerate(value)}
            flat.update(flatten_tensors(items, prefix=f"{path}."))
        else:
            flat[path] = value
    return flat


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
