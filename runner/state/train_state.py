"""The full training state as one dict that loads with ``torch.load(weights_only=True)``.

Layout (schema "2"; the checkpoint writer stores it as is)::

    {"schema": "2",
     "model": model.state_dict(),
     "param_names": [names in model.named_parameters() order],
     "optimizer": optimizer.state_dict(),          # AdamW: m (exp_avg), v (exp_avg_sq), step
     "scheduler": scheduler.state_dict() or {},
     "counters": {"step", "epoch", "batch_in_epoch", "samples_seen", "world_size"},  # ints
     "rng": runner.state.rng.capture_rng(),  # python, numpy, torch CPU, every CUDA device
     "sampler": ResumableSampler.state_dict() or {},
     "loss_history": [float, ...],                   # loss of steps 1..step
     "extra": {...},                                 # caller's plain data
     "user": {name: saved form}}                     # ModuleTrainState(extra=...), if any

Only tensors, ints, floats, strings, None, lists, tuples and dicts: no pickled objects.
Restoring returns the `Counters` to continue from; a resume at another world size rescales them
(see `runner.state.worldsize`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from runner.errors import ConfigError, IntegrityError
from runner.state import rng
from runner.state.counters import Counters
from runner.state.fingerprint import fingerprint as fingerprint_of
from runner.state.fingerprint import fingerprint_payload, full_fingerprint, gather_full
from runner.state.ranked import RankedPayload, load_tensor_state, split_payload, tensor_state
from runner.state.sampler import ResumableSampler
from runner.state.user import USER_KEY, capture_user, check_extra, check_user, restore_user
from runner.state.validate import TRAIN_STATE_SCHEMA, check_restorable
from runner.state.worldsize import (
    announce_schedule_move,
    move_scheduler_to_step,
    position_from_samples_seen,
    rescale_counters,
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ModuleTrainState:
    """TrainState for a plain PyTorch loop: model, optimizer, optional scheduler and sampler,
    and `extra`: named objects of the user's own that the checkpoint must hold too (an EMA, a
    GradScaler, a torch.Generator, a prefetched batch in a dict; runner.state.user)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    sampler: ResumableSampler | None = None
    world_size: int = 1
    counters: Counters = field(default_factory=Counters)
    loss_history: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # a subclass that moves the schedule again after the restore (the demo stretches it to the
    # run's length at the new world size) logs the one line itself, with the value it uses
    announce_schedule: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self.counters.world_size = self.world_size
        self.extra = check_extra(self.extra)

    def advance(self, *, loss: float, samples: int | None = None) -> None:
        """Record one completed optimizer step. `samples` defaults to the sampler's global batch."""
        if samples is None:
            samples = self.sampler.global_batch_size if self.sampler is not None else 0
        self.counters.step += 1
        self.counters.samples_seen += samples
        if self.sampler is not None:
            self.counters.epoch = self.sampler.epoch
            self.counters.batch_in_epoch = self.sampler.batch_in_epoch
        self.loss_history.append(float(loss))

    def capture(self, *, copy: bool = False, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return capture_train_state(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            counters=self.counters,
            sampler=self.sampler,
            loss_history=self.loss_history,
            extra=extra,
            user=capture_user(self.extra) if self.extra else None,
            copy=copy,
        )

    def restore(self, state: dict[str, Any], *, restore_rng: bool = True) -> Counters:
        return self.restore_using(state, restore_rng=restore_rng)

    def restore_using(
        self,
        state: dict[str, Any],
        *,
        restore_rng: bool = True,
        load_modules: Callable[[dict[str, Any]], None] | None = None,
    ) -> Counters:
        """`restore`, with the model/optimizer/scheduler load replaced by `load_modules`
        when given (DCP's tensors, a sharded model's full state)."""
        check_user(state.get(USER_KEY), self.extra)  # before anything is loaded
        self.counters = restore_train_state(
            state,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            sampler=self.sampler,
            world_size=self.world_size,
            restore_rng=restore_rng,
            load_modules=load_modules,
            announce_schedule=self.announce_schedule,
        )
        if self.extra:
            restore_user(state.get(USER_KEY), self.extra, step=self.counters.step)
        history = [float(x) for x in state.get("loss_history", [])]
        # A resume at more ranks rescaled the step down: the history counts the old size's
        # steps, so the part past the new step would claim steps this run has not taken.
        self.loss_history = history[: self.counters.step]
        return self.counters

    def load_into(
        self,
        read: Callable[[dict[str, Any]], dict[str, Any]],
        *,
        restore_rng: bool = True,
    ) -> Counters:
        """Load a checkpoint into the live model, optimizer, scheduler, sampler, counters and
        RNG; returns the counters to continue from.

        `read` gets this state's own capture (live tensors, the payload layout) as a template
        and returns the state to load: a whole-file reader returns what it deserialised, an
        in-place reader (DCP) fills the template's tensors and returns it. Checks come first,
        as in `restore`: a refused checkpoint leaves the live objects as they were."""
        return self.restore(read(self.capture()), restore_rng=restore_rng)

    def capture_ranked(self, *, rank: int, world_size: int) -> RankedPayload:
        """This rank's part of a multi-rank checkpoint (runner.state.ranked): the live
        tensors keyed by name for DCP, the shared and the per-rank parts."""
        payload = self.capture()
        return split_payload(
            payload, tensor_state(self.model, self.optimizer), rank=rank, world_size=world_size
        )

    def load_ranked(
        self,
        read_tensors: Callable[[dict[str, Any]], None],
        *,
        shared: dict[str, Any],
        own: dict[str, Any],
        restore_rng: bool = True,
    ) -> Counters:
        """Load a multi-rank checkpoint: `shared` and this rank's `own` part (RNG and sampler;
        with `rng` None when the checkpoint has no rank of this number: the RNG is left as
        seeded), the tensors by `read_tensors`, which fills the template it gets in place
        (DCP). The checks come first, as in `restore`."""
        state = {**shared, "model": {}, "optimizer": {}, **own}

        def load_modules(state: dict[str, Any]) -> None:
            template = tensor_state(self.model, self.optimizer)
            read_tensors(template)
            load_tensor_state(self.model, self.optimizer, template)
            if self.scheduler is not None and state.get("scheduler"):
                self.scheduler.load_state_dict(state["scheduler"])

        return self.restore_using(
            state, restore_rng=restore_rng and own.get("rng") is not None, load_modules=load_modules
        )

    def fingerprint(self) -> str:
        user = capture_user(self.extra) if self.extra else None
        return fingerprint_of(self.model, self.optimizer, user=user)

    def full_fingerprint(self, *, primary: bool = True) -> str:
        """The fingerprint of the full (unsharded) state on the primary rank ("" on the
        others). Every rank calls it at the same point: an FSDP model is gathered first
        (a collective); a whole one is hashed by the primary alone."""
        return full_fingerprint(self.model, self.optimizer, primary=primary)

    def gather_full(self, *, primary: bool = True) -> dict[str, Any] | None:
        """A sharded model's full state gathered to the primary (collective), for
        `fingerprint_tensors` to hash later; None on the other ranks."""
        return gather_full(self.model, self.optimizer, primary=primary)

    def fingerprint_captured(self, captured: dict[str, Any]) -> str:
        """The fingerprint of a `capture()` result: equal to `fingerprint()` at the moment of
        the capture, computed from the captured tensors (a copy, once saves copy)."""
        return fingerprint_payload(captured)


def capture_train_state(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    counters: Counters,
    sampler: ResumableSampler | None = None,
    loss_history: list[float] | None = None,
    extra: dict[str, Any] | None = None,
    user: dict[str, Any] | None = None,
    copy: bool = False,
) -> dict[str, Any]:
    """The training state in the documented layout.

    With ``copy=False`` the model and optimizer tensors are the live ones: write them before the
    next optimizer step. ``copy=True`` snapshots every tensor to CPU memory, so the result can
    be written by a background thread while training continues.
    """
    state: dict[str, Any] = {
        "schema": TRAIN_STATE_SCHEMA,
        "model": model.state_dict(),
        "param_names": [name for name, _ in model.named_parameters()],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else {},
        "counters": counters.to_dict(),
        "rng": rng.capture_rng(),
        "sampler": sampler.state_dict() if sampler is not None else {},
        "loss_history": [float(x) for x in (loss_history or [])],
        "extra": dict(extra or {}),
    }
    if user:
        state[USER_KEY] = user
    return _snapshot(state) if copy else state


def restore_train_state(
    state: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    sampler: ResumableSampler | None = None,
    world_size: int = 1,
    restore_rng: bool = True,
    load_modules: Callable[[dict[str, Any]], None] | None = None,
    announce_schedule: bool = True,
) -> Counters:
    """Load `state` into the live objects and return the counters to continue from.

    Raises SchemaError for an unknown schema, IntegrityError for a malformed state and
    ConfigError when the state belongs to another model or data order. ``restore_rng=False``
    exists for the resume audit (`runner drill`), which measures what skipping it costs.
    `load_modules` replaces the model/optimizer/scheduler load (a multi-rank checkpoint's
    tensors come from DCP: ModuleTrainState.load_ranked). `announce_schedule=False`: the
    caller moves the schedule again and logs the move itself.
    """
    saved_counters = check_restorable(
        state, model=model, sampler=sampler, world_size=world_size, restore_rng=restore_rng
    )
    if sampler is not None:
        # First among the loads: it refuses a state of another data order (ConfigError).
        _restore_sampler(state.get("sampler") or {}, sampler, saved_counters)
    if load_modules is not None:
        load_modules(state)
    else:
        _load_modules(state, model=model, optimizer=optimizer, scheduler=scheduler)
    if restore_rng:
        restore_rng_state(state)

    counters, change = rescale_counters(saved_counters, new_world_size=world_size)
    if change is not None and scheduler is not None:
        lrs = move_scheduler_to_step(scheduler, step=counters.step)
        if announce_schedule:
            announce_schedule_move(counters.step, lrs)
        else:
            log.debug(
                "LR schedule moved to step %d: lr=%s (the caller moves it again)",
                counters.step,
                lrs,
            )
    if sampler is not None:
        counters = dataclasses.replace(
            counters, epoch=sampler.epoch, batch_in_epoch=sampler.batch_in_epoch
        )
    return counters


def _load_modules(
    state: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> None:
    """The model's, optimizer's and scheduler's state dicts into them (ConfigError when one
    does not fit)."""
    try:
        model.load_state_dict(state["model"], strict=True)
    except RuntimeError as exc:
        raise ConfigError(
            f"checkpoint does not fit this model: {exc}; resume with the model that wrote it"
        ) from exc
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as exc:
        raise ConfigError(
            f"checkpoint's optimizer state does not fit this optimizer: {exc}"
        ) from exc
    if scheduler is not None and state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore the global RNGs from a captured train state."""
    try:
        section = state["rng"]
    except KeyError as exc:
        raise IntegrityError("train state has no RNG section") from exc
    rng.restore_rng(section)


def _restore_sampler(saved: dict[str, Any], sampler: ResumableSampler, counters: Counters) -> None:
    """Position `sampler` from its saved state, or from the saved run's sample count."""
    if saved:
        sampler.load_state_dict(saved)
    else:
        # No saved position (e.g. a state converted from a seed .bin): derive it from the
        # world-size-independent sample count, assuming the saved run kept one global batch
        # (this per-rank batch times its world size) throughout.
        epoch, offset = position_from_samples_seen(
            counters.samples_seen,
            num_samples=sampler.num_samples,
            global_batch_size=sampler.batch_size * counters.world_size,
        )
        sampler.seek(epoch=epoch, sample_offset=offset)
        log.info(
            "no sampler position in the checkpoint: resuming data at epoch %d, sample %d "
            "(from samples_seen=%d)",
            epoch,
            offset,
            counters.samples_seen,
        )


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_snapshot(v) for v in value)
    return value
