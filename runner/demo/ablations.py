"""What each omission in a checkpoint costs: the ablations of the resume audit (`runner drill`).

Each ablation damages a captured train state the way a careless checkpointing tool would (only
weights saved, data position forgotten, weights stored in half precision, RNG not saved). The
study trains the demo straight, then resumes it from a mid-run state, exactly and with each
ablation, and measures the damage against the straight run: the largest absolute weight
difference and the difference of the final loss. The exact resume must measure 0.0.

`run_ablation_study` runs in one process and simulates a fresh process by rebuilding the demo,
which reseeds every global generator; `runner drill` adds the real processes and signals.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runner.demo.components import DemoComponents, build_demo

EXACT = "exact resume"


@dataclass(frozen=True, kw_only=True, slots=True)
class Ablation:
    name: str
    description: str
    damage: Callable[[dict[str, Any]], dict[str, Any]]
    restores_rng: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class AblationResult:
    name: str
    description: str
    max_weight_diff: float
    final_loss_diff: float
    fingerprint_match: bool


def drop_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """Weights only: AdamW restarts with zero moments (m, v) and bias correction from step 0."""
    damaged = dict(state)
    damaged["optimizer"] = {**state["optimizer"], "state": {}}
    return damaged


def rewind_batch_order(state: dict[str, Any]) -> dict[str, Any]:
    """Data position lost: the resumed run replays the current epoch from its first batch."""
    damaged = dict(state)
    damaged["sampler"] = {**state["sampler"], "sample_offset": 0, "batch_in_epoch": 0}
    return damaged


def fp16_weights(state: dict[str, Any]) -> dict[str, Any]:
    """Weights stored in float16 and read back: every weight rounded to 11 significant bits."""
    damaged = dict(state)
    damaged["model"] = {
        name: t.to(torch.float16).to(t.dtype) if t.is_floating_point() else t
        for name, t in state["model"].items()
    }
    return damaged


def keep_state(state: dict[str, Any]) -> dict[str, Any]:
    return state


ABLATIONS: tuple[Ablation, ...] = (
    Ablation(name=EXACT, description="everything restored", damage=keep_state),
    Ablation(
        name="no optimizer state",
        description="AdamW moments dropped",
        damage=drop_optimizer_state,
    ),
    Ablation(
        name="batch order rewound",
        description="epoch replayed from its first batch",
        damage=rewind_batch_order,
    ),
    Ablation(
        name="fp16 weights", description="weights rounded through float16", damage=fp16_weights
    ),
    Ablation(
        name="RNG not restored",
        description="dropout and other draws restart from the seed",
        damage=keep_state,
        restores_rng=False,
    ),
)


def run_ablation_study(
    *,
    steps: int,
    stop_at: int,
    seed: int,
    device: str = "cpu",
    batch_size: int = 8,
    ablations: tuple[Ablation, ...] = ABLATIONS,
    **demo_overrides: Any,
) -> list[AblationResult]:
    """Straight run vs resumes from step `stop_at`, one per ablation; see the module docstring.

    Choose `stop_at` in the middle of an epoch (``demo_overrides`` may set ``max_samples`` to
    make epochs short), otherwise rewinding to the epoch start changes nothing.
    """
    if not 0 < stop_at < steps:
        raise ValueError(f"need 0 < stop_at < steps, got stop_at={stop_at} steps={steps}")

    def fresh() -> DemoComponents:
        return build_demo(
            seed=seed, device=device, batch_size=batch_size, total_steps=steps, **demo_overrides
        )

    straight = fresh()
    _train_until(straight, steps)
    reference = {name: t.detach().clone() for name, t in straight.model.state_dict().items()}
    reference_print = straight.fingerprint()

    interrupted = fresh()
    _train_until(interrupted, stop_at)
    saved = _through_disk(interrupted.capture())

    results = []
    for ablation in ablations:
        resumed = fresh()
        resumed.restore(ablation.damage(copy.deepcopy(saved)), restore_rng=ablation.restores_rng)
        _train_until(resumed, steps)
        results.append(
            AblationResult(
                name=ablation.name,
                description=ablation.description,
                max_weight_diff=_max_weight_diff(reference, resumed.model.state_dict()),
                final_loss_diff=abs(resumed.loss_history[-1] - straight.loss_history[-1]),
                fingerprint_match=resumed.fingerprint() == reference_print,
            )
        )
    return results


def _train_until(components: DemoComponents, step: int) -> None:
    while components.counters.step < step:
        components.train_step()


def _through_disk(state: dict[str, Any]) -> dict[str, Any]:
    # What a checkpoint holds is what survives serialisation and a weights-only load.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def _max_weight_diff(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, expected in reference.items():
        if expected.is_floating_point():
            diff = (other[name].detach().cpu().double() - expected.cpu().double()).abs().max()
            worst = max(worst, float(diff))
    return worst


def format_table(results: list[AblationResult]) -> str:
    """Plain-text table for the drill report."""
    header = f"{'omission':<22} {'max |dw|':>12} {'|d loss|':>12}  fingerprint"
    rows = [header, "-" * len(header)]
    for r in results:
        verdict = "identical" if r.fingerprint_match else "differs"
        rows.append(
            f"{r.name:<22} {r.max_weight_diff:>12.3e} {r.final_loss_diff:>12.3e}  {verdict}"
        )
    return "\n".join(rows)
