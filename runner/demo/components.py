"""Everything the demo job trains, assembled in one place: `build_demo`.

`runner demo` wraps these components in a session (checkpoints, signals, mirror); `runner drill`
builds them several times to compare straight and resumed runs. Building seeds every global
generator from ``seed``, as a fresh process would, so two builds with one seed train identically.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TextIO

import numpy as np
import torch

from runner.demo.corpus import DEFAULT_CHARS, generate_corpus
from runner.demo.data import CharVocab, WindowDataset
from runner.demo.model import TinyGPT
from runner.demo.sharding import PARALLEL_MODES, data_parallel, fully_shard_model
from runner.errors import ConfigError
from runner.state.counters import Counters
from runner.state.ranked import is_sharded, load_full_state
from runner.state.sampler import ResumableSampler
from runner.state.train_state import ModuleTrainState
from runner.state.worldsize import announce_schedule_move, move_scheduler_to_step


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """Hyperparameters of the demo job (the defaults train 200 CPU steps in seconds)."""

    seed: int = 0
    batch_size: int = 16
    total_steps: int = 200
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    context: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.1
    corpus_chars: int = DEFAULT_CHARS
    max_samples: int | None = None
    """Cap on windows per epoch: short epochs for tests that stop mid-epoch."""

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.total_steps}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


def warmup_cosine(config: DemoConfig) -> Callable[[int], float]:
    """LR multiplier as a function of the step: linear warmup, then cosine to `min_lr_ratio`."""
    warmup = max(1, min(config.warmup_steps, config.total_steps))
    decay = max(1, config.total_steps - warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / decay)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine

    return factor


@dataclass(kw_only=True)
class DemoComponents(ModuleTrainState):
    """The demo's model, optimizer, schedule, data and counters, and one training step.

    Capture, restore and fingerprint come from `ModuleTrainState`."""

    config: DemoConfig
    device: torch.device
    vocab: CharVocab
    dataset: WindowDataset
    model: TinyGPT
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: ResumableSampler
    parallel: torch.nn.Module | None = None
    """What forward and backward go through when several ranks train: with DDP the model
    wrapped in DistributedDataParallel (it averages the gradients; `model` stays the plain
    module, so state dicts are those of a single process); with FSDP2 the sharded `model`
    itself (`fully_shard`: DTensor parameters, each rank holds a shard of them and of the
    optimizer state)."""
    sample_log: TextIO | None = None
    """Where each step's sample indices go, one JSON line per step (`runner demo
    --sample-log`): the audit that every sample of an epoch is consumed once across a resume."""
    # after a resume at another world size `rescale_schedule` moves the schedule again, to the
    # run's length at this size, and logs that one line
    announce_schedule: ClassVar[bool] = False

    @property
    def done(self) -> bool:
        return self.counters.step >= self.config.total_steps

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets) on the training device; advances the data position."""
        epoch = self.sampler.epoch
        indices = self.sampler.next_batch()
        if self.sample_log is not None:
            line = {
                "step": self.counters.step + 1,
                "rank": self.sampler.rank,
                "epoch": epoch,
                "indices": indices,
            }
            self.sample_log.write(json.dumps(line) + "\n")
            self.sample_log.flush()
        inputs, targets = self.dataset.batch(indices)
        return inputs.to(self.device), targets.to(self.device)

    def train_step(self) -> float:
        """Forward, backward, clip, AdamW update, LR schedule; returns this step's loss."""
        self.model.train()
        inputs, targets = self.next_batch()
        if self.parallel is None:
            loss = self.model.loss(inputs, targets)
        else:
            logits = self.parallel(inputs)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, self.model.vocab_size), targets.reshape(-1)
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        value = self._mean_over_ranks(loss.detach())
        self.advance(loss=value)
        return value

    def _mean_over_ranks(self, loss: torch.Tensor) -> float:
        """This step's loss averaged over the ranks (the global batch's loss), so every rank
        records the same history."""
        if self.parallel is None:
            return float(loss.item())
        import torch.distributed as dist

        total = loss.clone()
        dist.all_reduce(total)
        return float(total.item()) / dist.get_world_size()

    def restore(self, state: dict[str, Any], *, restore_rng: bool = True) -> Counters:
        """`ModuleTrainState.restore`; a sharded model loads the whole state by each rank
        keeping its shard (a whole-file checkpoint of one process, at several FSDP ranks)."""
        if not is_sharded(self.model):
            return super().restore(state, restore_rng=restore_rng)

        def load_modules(state: dict[str, Any]) -> None:
            load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
            if state.get("scheduler"):
                self.scheduler.load_state_dict(state["scheduler"])

        return self.restore_using(state, restore_rng=restore_rng, load_modules=load_modules)

    def rescale_schedule(self, total_steps: int) -> None:
        """Stretch the LR schedule to a run of `total_steps` at this world size (the same
        run length in samples: after a resume at another world size the step counts in other
        units), then re-evaluate it at the current step."""
        if total_steps == self.config.total_steps:
            return
        ratio = total_steps / self.config.total_steps
        scaled = dataclasses.replace(
            self.config,
            total_steps=total_steps,
            warmup_steps=max(1, round(self.config.warmup_steps * ratio)),
        )
        self.scheduler.lr_lambdas = [warmup_cosine(scaled)]
        lrs = move_scheduler_to_step(self.scheduler, step=self.counters.step)
        announce_schedule_move(
            self.counters.step, lrs, why=f" (stretched to {total_steps} steps at this world size)"
        )
        self.config = scaled


def resolve_device(device: str) -> torch.device:
    """``"auto"``: CUDA when present, else CPU. Anything else is passed to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {device!r}: use auto, cpu or cuda[:N]") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for but CUDA is not available; use auto or cpu")
    return resolved


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) global generators, as a fresh process would."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def build_demo(
    *,
    seed: int,
    device: str,
    batch_size: int,
    total_steps: int,
    world_size: int = 1,
    rank: int = 0,
    parallel: str = "ddp",
    **overrides: Any,
) -> DemoComponents:
    """Fresh demo components. `overrides` are `DemoConfig` fields (e.g. ``max_samples=112``).
    `parallel`: how several ranks (an initialised process group) train, "ddp" or "fsdp"
    (FSDP2: each transformer block sharded, then the root); ignored for one process."""
    if parallel not in PARALLEL_MODES:
        raise ConfigError(f"unknown parallel mode {parallel!r}: use one of {PARALLEL_MODES}")
    try:
        config = DemoConfig(seed=seed, batch_size=batch_size, total_steps=total_steps, **overrides)
    except TypeError as exc:
        raise ConfigError(f"unknown demo setting: {exc}") from exc
    target = resolve_device(device)
    seed_everything(seed)
    text = generate_corpus(size=config.corpus_chars)
    vocab = CharVocab(text)
    dataset = WindowDataset(vocab.encode(text), context=config.context, limit=config.max_samples)
    model = TinyGPT(
        vocab_size=len(vocab),
        context=config.context,
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_layers=config.n_layers,
        dropout=config.dropout,
    ).to(target)
    distributed = world_size > 1 and torch.distributed.is_initialized()
    if distributed and parallel == "fsdp":
        fully_shard_model(model)  # before the optimizer: it must hold the sharded parameters
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.999), weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(config))
    sampler = ResumableSampler(
        len(dataset), batch_size=batch_size, seed=seed, world_size=world_size, rank=rank
    )
    wrapped: torch.nn.Module | None = None
    if distributed:
        # every rank starts from the same weights (seeded alike; DDP also broadcasts rank 0's,
        # fully_shard keeps each rank's shard of them), then draws its own dropout masks.
        # Without a process group the components of one rank are built alone (tests of the
        # sharding and resume rules).
        wrapped = model if parallel == "fsdp" else data_parallel(model, target)
        torch.manual_seed(_rank_seed(seed, rank))
    return DemoComponents(
        config=config,
        device=target,
        vocab=vocab,
        dataset=dataset,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        world_size=world_size,
        parallel=wrapped,
    )


def _rank_seed(seed: int, rank: int) -> int:
    return (seed * 1_000_003 + rank) % (1 << 63)
