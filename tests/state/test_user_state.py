"""`ModuleTrainState(extra={...})`: the user's own state (an EMA, a GradScaler-like object, a
torch.Generator, a tensor, a prefetched batch in a dict) saved with the rest, restored into the
live objects, counted in the fingerprint, and refused clearly when it cannot be."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from runner.errors import ConfigError
from runner.state import ModuleTrainState
from runner.state.fingerprint import fingerprint


class Scale:
    """A GradScaler-like object: plain numbers in its state dict."""

    def __init__(self) -> None:
        self.scale, self.growth = 65536.0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth": self.growth}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.growth = state["scale"], state["growth"]


def _parts(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    ema = torch.nn.Linear(4, 2)
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": model,
        "opt": torch.optim.AdamW(model.parameters()),
        "ema": ema,
        "scale": Scale(),
        "gen": gen,
        "mask": torch.zeros(3),
        "batch": {},
    }


def _state(p: dict[str, Any]) -> ModuleTrainState:
    extra = {k: p[k] for k in ("ema", "scale", "gen", "mask", "batch")}
    return ModuleTrainState(model=p["model"], optimizer=p["opt"], extra=extra)


def _saved(state: ModuleTrainState) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state.capture(copy=True), buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)  # no pickled objects
    return loaded


def test_every_kind_of_extra_is_saved_and_restored_into_the_live_objects() -> None:
    a = _parts(1)
    state = _state(a)
    with torch.no_grad():
        a["ema"].weight.fill_(0.5)
    a["scale"].scale, a["scale"].growth = 1024.0, 7
    torch.rand(5, generator=a["gen"])  # the generator moved on
    a["mask"][1] = 2.0
    a["batch"].update(x=torch.arange(6).reshape(2, 3), n=2)
    payload = _saved(state)
    captured_print = state.fingerprint_captured(payload)
    assert captured_print == state.fingerprint()

    b = _parts(2)  # another process: other values everywhere
    resumed = _state(b)
    resumed.restore(payload)
    assert resumed.fingerprint() == captured_print
    assert torch.equal(b["ema"].weight, a["ema"].weight)
    assert (b["scale"].scale, b["scale"].growth) == (1024.0, 7)
    assert torch.equal(torch.rand(3, generator=b["gen"]), torch.rand(3, generator=a["gen"]))
    assert torch.equal(b["mask"], torch.tensor([0.0, 2.0, 0.0]))
    assert set(b["batch"]) == {"x", "n"} and torch.equal(b["batch"]["x"], a["batch"]["x"])


def test_the_fingerprint_counts_the_extras_and_is_unchanged_without_them() -> None:
    a = _parts(1)
    state = _state(a)
    before = state.fingerprint()
    a["batch"]["x"] = torch.ones(2)
    assert state.fingerprint() != before  # a prefetched batch is part of the state
    plain = ModuleTrainState(model=a["model"], optimizer=a["opt"])
    assert plain.fingerprint() == fingerprint(a["model"], a["opt"])
    assert "user" not in plain.capture()  # the payload of a state without extras as before


def test_an_object_that_cannot_be_saved_is_refused_with_what_can() -> None:
    p = _parts(1)
    with pytest.raises(ConfigError, match=r"extra\['step_fn'\] is a function: give an object"):
        ModuleTrainState(model=p["model"], optimizer=p["opt"], extra={"step_fn": lambda: None})


def test_a_tensor_of_another_shape_is_refused_before_anything_loads() -> None:
    a = _parts(1)
    payload = _saved(_state(a))
    b = _parts(2)
    b["mask"] = torch.zeros(4)
    resumed = _state(b)
    weight = b["model"].weight.detach().clone()
    with pytest.raises(ConfigError, match=r"extra\['mask'\]: the checkpoint holds a torch.float32"):
        resumed.restore(payload)
    assert torch.equal(b["model"].weight, weight)  # the model was not touched


def test_an_extra_missing_from_the_checkpoint_is_named(caplog: pytest.LogCaptureFixture) -> None:
    a = _parts(1)
    payload = _saved(ModuleTrainState(model=a["model"], optimizer=a["opt"]))
    b = _parts(2)
    _state(b).restore(payload)
    missing = [r.getMessage() for r in caplog.records if "holds no extra" in r.getMessage()]
    assert len(missing) == 5 and "so this resume is not exact" in missing[0]
