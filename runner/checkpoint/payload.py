"""The train-state payload inside a checkpoint: its schema version and the v1 -> v2 migration.

v2 (current), agreed with runner/state/train_state.py:
    {"schema": "2", "model": state_dict, "param_names": [names in named_parameters() order],
     "optimizer": state_dict, "scheduler": {...},
     "counters": {"step", "epoch", "batch_in_epoch", "samples_seen", "world_size"},
     "rng": {...}, "sampler": {...}, "loss_history": [...], "extra": {}}

v1 (the first layout) had no "schema" key, flat counters at the top level ("step", "epoch",
"batch_in_epoch", "world_size", "batch_size"), no "samples_seen" and no "param_names".
"""

from __future__ import annotations

from typing import Any

from runner.errors import IntegrityError, SchemaError

# The torch-state format's payload file (not the sidecar runner.checkpoint.layout.STATE_FILE).
STATE_FILE = "state.pt"
PAYLOAD_SCHEMA = "2"
SUPPORTED_PAYLOAD_SCHEMAS = ("1", "2")
COUNTER_FIELDS = ("step", "epoch", "batch_in_epoch", "samples_seen", "world_size")


def payload_schema(state: dict[str, Any]) -> str:
    """ "1" for a payload without a schema key (the first layout), else its declared version."""
    return str(state.get("schema", "1"))


def with_schema(state: dict[str, Any]) -> dict[str, Any]:
    """The state as written: stamped with the current schema, never mutating the caller's dict
    (the writer may run on a snapshot in another thread)."""
    schema = payload_schema(state) if "schema" in state else PAYLOAD_SCHEMA
    if schema != PAYLOAD_SCHEMA:
        raise SchemaError(
            f"refusing to write a payload with schema {schema!r}; this runner writes "
            f"{PAYLOAD_SCHEMA!r}"
        )
    return state if "schema" in state else {"schema": PAYLOAD_SCHEMA, **state}


def migrate_payload(state: object, *, source: str) -> dict[str, Any]:
    """Bring a loaded payload of any supported schema to the current one."""
    if not isinstance(state, dict):
        raise IntegrityError(f"{source}: payload is a {type(state).__name__}, expected a dict")
    schema = payload_schema(state)
    if schema not in SUPPORTED_PAYLOAD_SCHEMAS:
        raise SchemaError(
            f"{source}: unknown payload schema {schema!r} (this runner reads "
            f"{', '.join(SUPPORTED_PAYLOAD_SCHEMAS)}); upgrade spot-runner to load it"
        )
    if schema == "1":
        state = _migrate_v1_to_v2(state, source=source)
    return state


def _int(value: object, *, name: str, source: str) -> int:
    if hasattr(value, "item"):  # a 0-d tensor
        value = value.item()
    if not isinstance(value, int) or isinstance(value, bool):
        raise IntegrityError(f"{source}: v1 counter {name!r} is {value!r}, expected an int")
    return value


def _migrate_v1_to_v2(v1: dict[str, Any], *, source: str) -> dict[str, Any]:
    """samples_seen = step x batch_size x world_size (exact for fixed-size batches, which is
    all v1 supported). v1 did not record parameter names: "param_names" is empty, and a
    restore uses the model's own named_parameters() order, as v1 did."""
    state = {k: v for k, v in v1.items() if k not in ("step", "epoch", "batch_in_epoch")}
    counters = {
        name: _int(v1.get(name, 0), name=name, source=source)
        for name in ("step", "epoch", "batch_in_epoch")
    }
    world_size = _int(state.pop("world_size", 1), name="world_size", source=source)
    batch_size = _int(state.pop("batch_size", 0), name="batch_size", source=source)
    counters["world_size"] = world_size
    counters["samples_seen"] = counters["step"] * batch_size * world_size
    state["counters"] = counters
    state["schema"] = PAYLOAD_SCHEMA
    state.setdefault("param_names", [])
    state.setdefault("loss_history", [])
    state["extra"] = {**state.get("extra", {}), "migrated_from": "1"}
    return state
