"""The in-process API: `TrainSession` (restore on start, save by policy, stop on request) and
the `TrainState` protocol it saves and loads (ModuleTrainState, in runner.state, fits).

The names resolve on first use (PEP 562): `import runner.session` loads neither torch nor the
checkpoint code; `from runner.session import TrainSession` loads what the session needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.session.capture import TrainState
    from runner.session.train_session import TrainSession

# each public name and the module that defines it
_HOMES = {
    "TrainSession": "runner.session.train_session",
    "TrainState": "runner.session.capture",
}
__all__ = ["TrainSession", "TrainState"]


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
