"""Preemption: stop requests, signal handlers and cloud preemption notices."""

from runner.preemption.stop import StopController, StopRequest

__all__ = ["StopController", "StopRequest"]
