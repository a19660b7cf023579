"""Where a run stands: the counters every checkpoint records and every resume rescales."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.errors import IntegrityError

COUNTER_FIELDS = ("step", "epoch", "batch_in_epoch", "samples_seen", "world_size")


@dataclass(kw_only=True)
class Counters:
    """Where a run stands. `step` counts completed optimizer updates."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    samples_seen: int = 0
    world_size: int = 1

    def to_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name in COUNTER_FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Counters:
        try:
            values = {name: int(data[name]) for name in COUNTER_FIELDS}
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"train state: counters are malformed ({exc!r})") from exc
        if any(v < 0 for v in values.values()) or values["world_size"] < 1:
            raise IntegrityError(f"train state: counters out of range: {values}")
        return cls(**values)
