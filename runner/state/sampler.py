"""A batch sampler whose position can be saved and restored mid-epoch.

The order of an epoch is a pure function of ``(seed, epoch)``: a private ``torch.Generator``
seeded from both, never the global RNG, so restoring the global RNG and the data order are
independent concerns. The position is kept as ``sample_offset``, the number of samples of the
epoch's order already consumed by all ranks together. That number does not depend on the world
size, so a resume with more or fewer ranks continues at the exact next sample.

Sharding: a global batch is ``batch_size * world_size`` consecutive entries of the epoch's order;
rank ``r`` takes the ``r``-th slice of ``batch_size``. Ranks therefore get disjoint samples, and
the union over ranks is the same whatever the world size. The tail of an epoch too short for a
full global batch is dropped (every rank must take the same number of steps).

The position advances when a batch is handed out, so a state captured after the training step
that used it says "consumed". Use it directly (``next_batch()``) or as a DataLoader
``batch_sampler`` with ``num_workers=0``; a prefetching loader would draw batches ahead of the
step that consumes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch

from runner.errors import ConfigError, IntegrityError

SAMPLER_STATE_VERSION = 1


class ResumableSampler:
    """Shuffled, sharded, resumable batches of indices into a dataset of `num_samples` items."""

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        seed: int,
        world_size: int = 1,
        rank: int = 0,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(
                f"need world_size >= 1 and 0 <= rank < world_size, got {rank=} {world_size=}"
            )
        if num_samples < batch_size * world_size:
            raise ConfigError(
                f"dataset of {num_samples} samples is smaller than one global batch "
                f"({batch_size} x {world_size} ranks); use a smaller batch or more data"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.world_size = world_size
        self.rank = rank
        self.shuffle = shuffle
        self.epoch = 0
        self.sample_offset = 0
        self.batch_in_epoch = 0
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        """Batches in a whole epoch at this world size (from sample offset 0)."""
        return self.num_samples // self.global_batch_size

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The permutation of the dataset for `epoch`: identical for every rank and process."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if self.shuffle:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        self._order = (epoch, order)
        return order

    def next_batch(self) -> list[int]:
        """This rank's next batch of indices; rolls into the next epoch when this one runs out."""
        order = self.epoch_order(self.epoch)
        start = self.sample_offset + self.rank * self.batch_size
        batch = order[start : start + self.batch_size].tolist()
        self.sample_offset += self.global_batch_size
        self.batch_in_epoch += 1
        # Roll over eagerly so that a state captured after the last batch of an epoch reads
        # (epoch + 1, batch 0), like the counters of a loop that just finished the epoch.
        if self.sample_offset + self.global_batch_size > self.num_samples:
            self._start_epoch(self.epoch + 1)
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch (a DataLoader `batch_sampler` protocol)."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return (self.num_samples - self.sample_offset) // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of `epoch` (the usual DistributedSampler call).

        Calling it with the current epoch keeps the position, so the customary
        ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop does not undo a
        mid-epoch resume.
        """
        if epoch != self.epoch:
            self._start_epoch(epoch)

    def seek(self, *, epoch: int, sample_offset: int) -> None:
        """Move to `sample_offset` samples into `epoch` (e.g. a position derived from a count)."""
        if epoch < 0 or not 0 <= sample_offset <= self.num_samples:
            raise ConfigError(f"sampler position out of range: {epoch=} {sample_offset=}")
        self.epoch, self.sample_offset = epoch, sample_offset
        self.batch_in_epoch = sample_offset // self.global_batch_size
        if self.sample_offset + self.global_batch_size > self.num_samples:
            self._start_epoch(self.epoch + 1)

    def _start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sample_offset = 0
        self.batch_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": SAMPLER_STATE_VERSION,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "sample_offset": self.sample_offset,
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` stopped, at this sampler's own world size and rank.

        Raises ConfigError when the saved order cannot be this one (other seed, dataset size
        or shuffling), IntegrityError when the state is malformed.
        """
        try:
            version = int(state["version"])
            seed, num_samples = int(state["seed"]), int(state["num_samples"])
            shuffle = bool(state["shuffle"])
            epoch, offset = int(state["epoch"]), int(state["sample_offset"])
            batch_in_epoch = int(state["batch_in_epoch"])
            saved_global = int(state["global_batch_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise IntegrityError(f"sampler state is malformed ({exc!r})") from exc
        if version != SAMPLER_STATE_VERSION:
            raise IntegrityError(
                f"sampler state version {version} is not {SAMPLER_STATE_VERSION}; "
                "upgrade the runner that reads it"
            )
        mine = (self.seed, self.num_samples, self.shuffle)
        if (seed, num_samples, shuffle) != mine:
            raise ConfigError(
                f"checkpoint's data order (seed={seed}, num_samples={num_samples}, "
                f"shuffle={shuffle}) differs from this run's (seed={mine[0]}, "
                f"num_samples={mine[1]}, shuffle={mine[2]}); resume with the same data and seed, "
                "or start a new run directory"
            )
        if not 0 <= offset <= num_samples or epoch < 0:
            raise IntegrityError(f"sampler position out of range: {epoch=} sample_offset={offset}")
        self.epoch, self.sample_offset = epoch, offset
        if saved_global == self.global_batch_size:
            self.batch_in_epoch = batch_in_epoch
        else:
            # Another world size: the offset in samples is exact; count batches in new units.
            self.batch_in_epoch = offset // self.global_batch_size
        if self.sample_offset + self.global_batch_size > self.num_samples:
            self._start_epoch(self.epoch + 1)


def _epoch_seed(seed: int, epoch: int) -> int:
    # Hash rather than seed + epoch: neighbouring (seed, epoch) pairs must not share streams.
    raw = hashlib.sha256(f"spot-runner-sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(raw[:8], "little") & ((1 << 63) - 1)
