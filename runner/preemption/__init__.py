"""Preemption: stop requests, signal handlers and cloud preemption notices.

Imports nothing on purpose: `early` is imported while the process is still starting
(runner/entry.py), before anything but `signal` and `time` may load. The public names below
resolve on first use (PEP 562): `StopController`, `install_signal_handlers`, `exit_process`.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

    from runner.preemption.exiting import exit_process
    from runner.preemption.signals import install_signal_handlers
    from runner.preemption.stop import StopController

# each public name and the module that defines it
_HOMES = {
    "StopController": "runner.preemption.stop",
    "exit_process": "runner.preemption.exiting",
    "install_signal_handlers": "runner.preemption.signals",
}
__all__ = ["StopController", "exit_process", "install_signal_handlers"]


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
