"""Capture and restore of the full train state: layout, weights-only loading, RNG, errors."""

from __future__ import annotations

import io
import logging
import random
from typing import Any

import numpy as np
import pytest
import torch

from runner.errors import ConfigError, IntegrityError, SchemaError
from runner.state.rng import capture_rng, restore_rng
from runner.state.sampler import ResumableSampler
from runner.state.train_state import Counters, capture_train_state, restore_train_state


def _setup(
    init_seed: int = 0,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, ResumableSampler]:
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    sampler = ResumableSampler(40, batch_size=4, seed=0)
    return model, optimizer, scheduler, sampler


def _train(model: torch.nn.Module, optimizer: Any, scheduler: Any, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def _through_disk(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _walk(value: Any) -> list[type]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _walk(v)] + [type(k) for k in value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _walk(v)]
    return [type(value)]


def _captured(steps: int = 3) -> tuple[dict[str, Any], tuple[Any, ...]]:
    model, optimizer, scheduler, sampler = _setup()
    _train(model, optimizer, scheduler, steps)
    sampler.next_batch()
    counters = Counters(step=steps, epoch=0, batch_in_epoch=1, samples_seen=4, world_size=1)
    state = capture_train_state(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        counters=counters,
        sampler=sampler,
        loss_history=[3.0, 2.0, 1.5],
        extra={"note": "x"},
    )
    return state, (model, optimizer, scheduler, sampler)


def test_layout_has_the_agreed_keys_and_only_plain_types() -> None:
    state, _ = _captured()
    assert set(state) == {
        "schema", "model", "param_names", "optimizer", "scheduler", "counters",
        "rng", "sampler", "loss_history", "extra",
    }  # fmt: skip
    assert state["schema"] == "2"
    assert state["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert state["counters"] == {
        "step": 3, "epoch": 0, "batch_in_epoch": 1, "samples_seen": 4, "world_size": 1,
    }  # fmt: skip
    assert set(state["rng"]) == {"python", "numpy", "torch_cpu", "cuda", "torch_threads"}
    allowed = {torch.Tensor, int, float, str, bool, type(None)}
    assert {t for t in _walk(state) if not issubclass(t, torch.Tensor)} <= allowed
    assert not any(issubclass(t, np.ndarray | np.generic) for t in _walk(state))


def test_state_loads_weights_only_and_restores_everything() -> None:
    state, (model, optimizer, scheduler, _) = _captured()
    loaded = _through_disk(state)
    expected_next = (random.random(), float(np.random.rand()), torch.rand(3))
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_lr = scheduler.get_last_lr()

    model2, optimizer2, scheduler2, sampler2 = _setup(init_seed=99)
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    counters = restore_train_state(
        loaded, model=model2, optimizer=optimizer2, scheduler=scheduler2, sampler=sampler2
    )

    assert counters == Counters(step=3, epoch=0, batch_in_epoch=1, samples_seen=4, world_size=1)
    assert all(torch.equal(a, b) for a, b in zip(expected_params, model2.parameters(), strict=True))
    for key in ("exp_avg", "exp_avg_sq", "step"):
        for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.equal(optimizer.state[p1][key], optimizer2.state[p2][key])
    assert scheduler2.get_last_lr() == expected_lr
    assert scheduler2.last_epoch == 3
    assert sampler2.state_dict() == state["sampler"]
    got_next = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got_next[:2] == expected_next[:2]
    assert torch.equal(got_next[2], expected_next[2])


def test_rng_capture_covers_python_numpy_torch_and_gauss_caches() -> None:
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    random.gauss(0, 1)  # leaves a cached second normal in both generators
    np.random.standard_normal()
    state = _through_disk(capture_rng())
    expected = (random.gauss(0, 1), float(np.random.standard_normal()), torch.randn(2))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    restore_rng(state)
    got = (random.gauss(0, 1), float(np.random.standard_normal()), torch.randn(2))
    assert got[:2] == expected[:2]
    assert torch.equal(got[2], expected[2])


def test_copy_snapshot_is_independent_of_later_training() -> None:
    model, optimizer, scheduler, _ = _setup()
    _train(model, optimizer, scheduler, 1)
    live = capture_train_state(model=model, optimizer=optimizer, counters=Counters())
    snap = capture_train_state(model=model, optimizer=optimizer, counters=Counters(), copy=True)
    before = snap["model"]["0.weight"].clone()
    _train(model, optimizer, scheduler, 1)
    assert torch.equal(snap["model"]["0.weight"], before)
    assert not torch.equal(live["model"]["0.weight"], before)  # live tensors moved on


def test_unknown_schema_is_refused() -> None:
    state, (model, optimizer, *_rest) = _captured()
    with pytest.raises(SchemaError, match="schema '9'"):
        restore_train_state({**state, "schema": "9"}, model=model, optimizer=optimizer)


def test_missing_section_is_an_integrity_error() -> None:
    state, (model, optimizer, *_rest) = _captured()
    incomplete = {k: v for k, v in state.items() if k != "counters"}
    with pytest.raises(IntegrityError, match=r"lacks \['counters'\]"):
        restore_train_state(incomplete, model=model, optimizer=optimizer)
    no_rng = {k: v for k, v in state.items() if k != "rng"}
    with pytest.raises(IntegrityError, match="no RNG section"):
        restore_train_state(no_rng, model=model, optimizer=optimizer)


def test_malformed_counters_are_refused_before_anything_is_loaded() -> None:
    state, _ = _captured()
    model, optimizer, _, _ = _setup(init_seed=5)
    before = [p.detach().clone() for p in model.parameters()]
    bad = {**state, "counters": {**state["counters"], "step": -1}}
    with pytest.raises(IntegrityError, match="out of range"):
        restore_train_state(bad, model=model, optimizer=optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert optimizer.state_dict()["state"] == {}


def test_state_of_another_model_is_refused_with_names() -> None:
    state, _ = _captured()
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(ConfigError, match="does not fit this model"):
        restore_train_state(state, model=other, optimizer=optimizer)
    renamed = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"only in checkpoint: \['2.bias', '2.weight'\]"):
        restore_train_state(state, model=renamed, optimizer=torch.optim.AdamW(renamed.parameters()))


def test_sampler_of_another_seed_is_refused() -> None:
    state, (model, optimizer, *_rest) = _captured()
    with pytest.raises(ConfigError, match="data order"):
        restore_train_state(
            state,
            model=model,
            optimizer=optimizer,
            sampler=ResumableSampler(40, batch_size=4, seed=1),
        )


def test_state_migrated_from_schema_1_without_param_names_restores() -> None:
    state, (model, *_rest) = _captured()
    migrated = {**state, "param_names": []}
    model2, optimizer2, _, _ = _setup(init_seed=5)
    counters = restore_train_state(migrated, model=model2, optimizer=optimizer2)
    assert counters.step == 3
    assert torch.equal(model2[0].weight, model[0].weight)


def test_resume_with_another_thread_count_warns(caplog: pytest.LogCaptureFixture) -> None:
    # CPU kernels split reductions by thread: a different count changes the low bits.
    state = capture_rng()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(before + 1)
        with caplog.at_level(logging.WARNING, logger="runner.state.rng"):
            restore_rng(state)
    finally:
        torch.set_num_threads(before)
    assert f"written with {before} torch intra-op thread(s), this process uses {before + 1}" in (
        caplog.text
    )
