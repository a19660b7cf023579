"""The resume audit's ablations: the exact resume costs nothing, each omission costs something."""

from __future__ import annotations

import pytest
import torch

from runner.demo.ablations import (
    ABLATIONS,
    EXACT,
    drop_optimizer_state,
    format_table,
    fp16_weights,
    rewind_batch_order,
    run_ablation_study,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.slow
def test_exact_resume_is_free_and_every_omission_costs() -> None:
    # 7 batches per epoch; stopping at step 11 is mid-epoch (epoch 1, batch 4).
    results = run_ablation_study(steps=20, stop_at=11, seed=3, max_samples=56)
    by_name = {r.name: r for r in results}
    assert list(by_name) == [a.name for a in ABLATIONS]
    exact = by_name.pop(EXACT)
    assert (exact.max_weight_diff, exact.final_loss_diff, exact.fingerprint_match) == (
        0.0,
        0.0,
        True,
    )
    for name, result in by_name.items():
        assert result.max_weight_diff > 0.0, name
        assert result.final_loss_diff > 0.0, name
        assert not result.fingerprint_match, name
    table = format_table(results)
    assert table.splitlines()[2].startswith("exact resume")
    assert "0.000e+00" in table.splitlines()[2]


def test_damage_functions_change_only_their_part() -> None:
    state = {
        "model": {"w": torch.tensor([1.0001]), "n": torch.tensor([3])},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(1)}}, "param_groups": [{"lr": 1.0}]},
        "sampler": {"epoch": 2, "sample_offset": 40, "batch_in_epoch": 5},
    }
    assert drop_optimizer_state(state)["optimizer"] == {"state": {}, "param_groups": [{"lr": 1.0}]}
    assert rewind_batch_order(state)["sampler"] == {
        "epoch": 2, "sample_offset": 0, "batch_in_epoch": 0,
    }  # fmt: skip
    halved = fp16_weights(state)["model"]
    assert halved["w"].item() == 1.0 and halved["w"].dtype == torch.float32
    assert halved["n"] is state["model"]["n"]
    assert state["sampler"]["sample_offset"] == 40  # the original is untouched
