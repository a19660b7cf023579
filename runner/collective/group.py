"""The ranks' own channel: a dedicated gloo process group for the runner's control traffic.

Every rank of a torchrun job must decide the same thing after the same step (stop, save, at
which step), so the runner needs a few tiny collectives of its own. They run on a gloo group
created for the runner alone: on CPU even when the training group is nccl (control traffic never
waits behind, or interleaves with, the model's collectives on the GPU stream), and with its own
timeout, which bounds how long a rank waits for a peer that hangs.

A collective that fails (a peer died: gloo sees the closed connection at once; or the timeout
expired) raises PeerLostError: the group is unusable from then on, and the only safe move is to
exit non-zero and leave the last committed checkpoint as it stands.

`SINGLE` is the world of one: identity operations, no torch.distributed needed, so single-process
code calls the same API and pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from runner.errors import ConfigError, PeerLostError

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Group:
    """This process's place in the runner's channel. Every rank calls the same collectives in
    the same order with arguments of the same shape (as torch.distributed requires): `agree`
    with the same number of values everywhere."""

    rank: int = 0
    world_size: int = 1
    process_group: dist.ProcessGroup | None = field(default=None, repr=False)
    """The dedicated gloo group; None for a single process."""
    timeout_s: float | None = None

    @property
    def single(self) -> bool:
        """Alone in its world (SINGLE, or a torchrun launch of one rank): every decision is
        this rank's own."""
        return self.world_size == 1

    def agree(self, values: Sequence[int]) -> tuple[int, ...]:
        """Elementwise MAX of `values` over the ranks: one all-reduce of a small int64 tensor.
        Flags (0/1) agree as "any rank", steps as "the furthest rank"."""
        if self.process_group is None:
            return tuple(int(v) for v in values)
        tensor = torch.tensor(list(values), dtype=torch.int64)
        self._run("agree", lambda pg: dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=pg))
        return tuple(int(v) for v in tensor.tolist())

    def broadcast(self, obj: T, *, src: int = 0) -> T:
        """`src`'s `obj` on every rank (pickled; others' `obj` is ignored). `src` is a rank of
        this group (its ranks are the global ranks: the group spans the whole world)."""
        if self.process_group is None:
            return obj
        box: list[Any] = [obj if self.rank == src else None]
        self._run("broadcast", lambda pg: dist.broadcast_object_list(box, src=src, group=pg))
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by rank (pickled)."""
        if self.process_group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._run("all_gather", lambda pg: dist.all_gather_object(out, obj, group=pg))
        return out

    def barrier(self) -> None:
        if self.process_group is not None:
            self._run("barrier", lambda pg: dist.barrier(group=pg))

    def _run(self, what: str, op: Callable[[dist.ProcessGroup], R]) -> R:
        assert self.process_group is not None
        try:
            return op(self.process_group)
        except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo's timeouts
            raise peer_lost(
                self.rank, self.world_size, f"({what}) with the other ranks", exc, self.timeout_s
            ) from exc


def peer_lost(
    rank: int, world_size: int, where: str, exc: BaseException, timeout_s: float | None = None
) -> PeerLostError:
    """The one message for a collective that failed `where` because a peer died or hung
    (gloo's reset connection, a timeout): whichever collective sees it first says the same."""
    cause = " ".join(str(exc).split())[:300] or type(exc).__name__
    bound = f" (timeout {timeout_s:g} s)" if timeout_s is not None else ""
    return PeerLostError(
        f"rank {rank} of {world_size}: a collective {where} failed{bound}: "
        f"{type(exc).__name__}: {cause}. A peer process died or hung; this rank stops too. "
        "The last committed checkpoint stands: resume from it."
    )


SINGLE = Group()


def dedicated_group(*, timeout_s: float) -> Group:
    """A new gloo group over every rank of the initialised default group, for the runner alone.

    torch.distributed must already be initialised (by the user, or the demo from torchrun's
    environment). new_group is collective: every rank calls this at the same point, in the same
    order relative to its other new_group calls. `timeout_s` bounds each collective: a rank that
    waits longer for a peer gets PeerLostError."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "the runner's rank channel needs torch.distributed initialised first "
            "(torch.distributed.init_process_group, e.g. from torchrun's environment)"
        )
    if timeout_s <= 0:
        raise ConfigError(f"the rank channel's timeout must be > 0 s (got {timeout_s})")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise peer_lost(rank, world_size, "creating the runner's gloo group", exc) from exc
    return Group(rank=rank, world_size=world_size, process_group=pg, timeout_s=timeout_s)
