"""fingerprint(): equal for bit-identical states, different otherwise, stable across processes."""

from __future__ import annotations

import copy
import io
import subprocess
import sys

import pytest
import torch

from runner.state.fingerprint import fingerprint, fingerprint_state

BUILD = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
for _ in range(2):
    optimizer.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
"""


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    scope: dict = {}
    exec(BUILD, scope)
    return scope["model"], scope["optimizer"]


@pytest.mark.slow
def test_same_state_same_fingerprint_in_another_process() -> None:
    model, optimizer = _build()
    here = fingerprint(model, optimizer)
    code = (
        BUILD
        + "from runner.state.fingerprint import fingerprint\n"
        + "print(fingerprint(model, optimizer))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert len(here) == 64
    assert here == there


def test_fingerprint_of_state_dicts_equals_live_and_survives_serialisation() -> None:
    model, optimizer = _build()
    buffer = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert fingerprint_state(loaded["m"], loaded["o"]) == fingerprint(model, optimizer)


def test_one_ulp_in_a_weight_or_a_moment_changes_it() -> None:
    model, optimizer = _build()
    base = fingerprint(model, optimizer)
    with torch.no_grad():
        weight = model[0].weight
        weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(1.0))
    assert fingerprint(model, optimizer) != base

    model, optimizer = _build()
    state = optimizer.state[model[2].bias]
    state["exp_avg_sq"][1] = torch.nextafter(state["exp_avg_sq"][1], torch.tensor(1.0))
    assert fingerprint(model, optimizer) != base


def test_optimizer_step_count_and_missing_optimizer_count() -> None:
    model, optimizer = _build()
    base = fingerprint(model, optimizer)
    optimizer.state[model[0].weight]["step"] += 1
    assert fingerprint(model, optimizer) != base
    assert fingerprint(model, None) != base


def test_dtype_shape_and_names_are_part_of_the_digest() -> None:
    zeros = torch.zeros(4)
    assert fingerprint_state({"a": zeros}, None) != fingerprint_state({"a": zeros.double()}, None)
    assert fingerprint_state({"a": zeros}, None) != fingerprint_state({"a": zeros.view(2, 2)}, None)
    assert fingerprint_state({"a": zeros}, None) != fingerprint_state({"b": zeros}, None)
    # Same bytes split differently between two tensors must not collide either.
    split_a = {"a": torch.zeros(1), "b": torch.zeros(3)}
    split_b = {"a": torch.zeros(2), "b": torch.zeros(2)}
    assert fingerprint_state(split_a, None) != fingerprint_state(split_b, None)


def test_order_is_canonical_not_insertion_order() -> None:
    model, optimizer = _build()
    state = model.state_dict()
    reversed_state = dict(reversed(list(state.items())))
    opt_state = copy.deepcopy(optimizer.state_dict())
    opt_state["state"] = dict(reversed(list(opt_state["state"].items())))
    assert fingerprint_state(reversed_state, opt_state) == fingerprint(model, optimizer)


def test_bfloat16_and_empty_tensors_hash() -> None:
    one = fingerprint_state({"w": torch.ones(3, dtype=torch.bfloat16), "e": torch.empty(0)}, None)
    two = fingerprint_state({"w": torch.ones(3, dtype=torch.float16), "e": torch.empty(0)}, None)
    assert one != two


def test_swapped_state_dicts_are_refused() -> None:
    model, optimizer = _build()
    with pytest.raises(TypeError, match="looks like an optimizer state_dict"):
        fingerprint_state(optimizer.state_dict(), model.state_dict())
