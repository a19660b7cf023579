"""spot-runner: make training on spot / preemptible GPUs safe."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__", "log_to_stderr"]

if TYPE_CHECKING:
    from runner.console.logsetup import log_to_stderr


def __getattr__(name: str) -> Any:
    # lazy (PEP 562): `import runner` stays free of side effects and of imports
    if name == "log_to_stderr":
        from runner.console.logsetup import log_to_stderr

        return log_to_stderr
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
