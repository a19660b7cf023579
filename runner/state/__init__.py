"""What a training run's state is made of and how it is saved and restored: `ModuleTrainState`
(model, optimizer, scheduler, sampler, counters, RNG), `ResumableSampler` (a data order that
is a function of seed and epoch, resumable mid-epoch) and `Counters`.

The names resolve on first use (PEP 562): `import runner.state` loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.state.counters import Counters
    from runner.state.sampler import ResumableSampler
    from runner.state.train_state import ModuleTrainState

# each public name and the module that defines it
_HOMES = {
    "Counters": "runner.state.counters",
    "ModuleTrainState": "runner.state.train_state",
    "ResumableSampler": "runner.state.sampler",
}
__all__ = ["Counters", "ModuleTrainState", "ResumableSampler"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
