"""The demo's process group under torchrun: gloo on CPU, nccl on CUDA, one GPU per local rank.

A user's own script does the same before building its TrainSession; the runner's own
coordination then runs on a separate gloo group (runner.collective) either way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from runner.demo.components import resolve_device
from runner.preemption.exiting import end_without_teardown
from runner.runtime.rank import RankContext

log = logging.getLogger(__name__)


@contextlib.contextmanager
def process_group(rank: RankContext, device: str) -> Iterator[str]:
    """Initialise torch.distributed from torchrun's environment for a coordinated launch of
    several ranks (destroyed on exit); yields the device this rank trains on."""
    if not rank.coordinated or rank.world_size == 1:
        yield device
        return
    import torch
    import torch.distributed as dist

    resolved = resolve_device(device)
    if resolved.type == "cuda":
        index = resolved.index if resolved.index is not None else rank.local_rank
        torch.cuda.set_device(index)
        device, backend = f"cuda:{index}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    dist.init_process_group(backend=backend)
    log.info(
        "rank %d of %d (node %d, local rank %d): %s on %s",
        rank.rank,
        rank.world_size,
        rank.node_rank,
        rank.local_rank,
        backend,
        device,
    )
    try:
        yield device
    finally:
        with contextlib.suppress(Exception):  # a peer that died leaves nothing to tear down
            dist.destroy_process_group()
        end_without_teardown()  # gloo's threads outlive it (runner.preemption.exiting)


def gather_from_ranks(obj: Any) -> list[Any]:
    """Every rank's `obj`, indexed by rank, over the default process group (the one DDP and
    FSDP use: a peer that died fails it at once, as theirs)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
