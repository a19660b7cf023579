"""Where a plain `torch.utils.data.DataLoader` is in its epoch, so that a resume mid-epoch sees
the batches an uninterrupted run would have seen next.

A loader's order is drawn from the global RNG when its iterator is made (the base seed) and at
its first batch (a shuffling sampler's seed); a framework that resumes mid-epoch makes a new
iterator from whatever the RNG holds then, and starts at the epoch's first batch. Here each
iterator records the RNG as it was made (`epoch_rng`); the resumed one is made at its first
batch from that RNG, skips the batches already trained, and then puts the RNG back to where
the checkpoint left it, so training draws what it would have drawn.

Exact when fetching a batch draws nothing from the global RNG after the iterator's start (no
random transforms in the main process; workers are seeded from the base seed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from runner.state.rng import capture_rng, restore_rng


@dataclass(frozen=True)
class Position:
    epoch_rng: dict[str, Any] | None
    """The global RNG when this epoch's iterator was made."""
    trained: int
    """Batches of this epoch trained on (0 at an epoch's end: the next one starts afresh)."""


class ResumableLoader:
    """Mixed into a loader's class by `make_resumable` (its instance keeps every attribute)."""

    _spot_base_iter: Callable[[], Iterator[Any]]  # the loader class's own __iter__

    _spot_trained: Callable[[], int]
    _spot_epoch_rng: dict[str, Any] | None = None
    _spot_resume: Position | None = None

    def __iter__(self) -> Any:
        resume = self._spot_resume
        if resume is not None:
            self._spot_resume = None
            return _Resumed(self, resume)
        self._spot_epoch_rng = capture_rng()
        return self._spot_base_iter()

    def _spot_fresh_iter(self) -> Iterator[Any]:
        return self._spot_base_iter()

    def position(self) -> Position:
        return Position(epoch_rng=self._spot_epoch_rng, trained=self._spot_trained())

    def resume_at(self, position: Position) -> None:
        """The next iterator continues `position`'s epoch after its trained batches."""
        self._spot_resume = position

    # the stateful-loader interface frameworks look for (Lightning): the position itself is
    # carried by the integration, per rank; a framework then neither warns nor keeps a copy
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class _Resumed:
    """The resumed epoch's iterator, made at its first batch: by then the framework has set
    the sampler's epoch (a DistributedSampler's order is f(seed, epoch))."""

    def __init__(self, loader: ResumableLoader, resume: Position) -> None:
        self._loader = loader
        self._resume = resume
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _Resumed:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = self._start()
        return next(self._it)

    def _start(self) -> Iterator[Any]:
        loader, resume = self._loader, self._resume
        now = capture_rng()  # the checkpoint's RNG, restored by the integration
        if resume.trained == 0 or resume.epoch_rng is None:
            loader._spot_epoch_rng = now
            return loader._spot_fresh_iter()
        restore_rng(resume.epoch_rng)
        loader._spot_epoch_rng = resume.epoch_rng
        it = loader._spot_fresh_iter()
        for _ in range(resume.trained):
            next(it)
        restore_rng(now)
        return it


_CLASSES: dict[type, type] = {}


def make_resumable(loader: DataLoader[Any], *, trained: Callable[[], int]) -> ResumableLoader:
    """`loader` itself, its class extended with ResumableLoader (an epoch's RNG recorded at
    every new iterator). `trained()`: batches of the current epoch trained on so far."""
    if not isinstance(loader, ResumableLoader):
        cls = type(loader)
        if cls not in _CLASSES:
            # the loader's class first (an instance's layout must stay its class's for the
            # swap), with this __iter__ in front of its own
            _CLASSES[cls] = type(
                f"Resumable{cls.__name__}",
                (cls, ResumableLoader),
                {"__iter__": ResumableLoader.__iter__, "_spot_base_iter": cls.__iter__},
            )
        loader.__class__ = _CLASSES[cls]
    assert isinstance(loader, ResumableLoader)
    loader._spot_trained = trained
    return loader
