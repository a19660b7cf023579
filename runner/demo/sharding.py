"""How several ranks train the demo model (`runner demo --parallel`).

    ddp   every rank holds the whole model and optimizer state; DistributedDataParallel
          averages the gradients (forward and backward go through its wrapper)
    fsdp  FSDP2 (`fully_shard`): each rank holds a shard of every parameter and of the
          optimizer state; the module itself, its parameters DTensors, is what trains

torch is imported inside the functions: the CLI reads PARALLEL_MODES before it imports torch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from runner.demo.model import TinyGPT

log = logging.getLogger(__name__)

PARALLEL_MODES = ("ddp", "fsdp")


def fully_shard_model(model: TinyGPT) -> None:
    """FSDP2 over the default process group: each block its own unit (its parameters are
    gathered for its forward and backward only), then the root for the rest (embeddings,
    final norm, head). The module stays `model`; build its optimizer after this."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    log.info(
        "fully_shard: %d blocks and the root over %d ranks",
        len(model.blocks),
        dist.get_world_size(),
    )


def data_parallel(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` wrapped in DistributedDataParallel on `device` (one GPU per rank on CUDA)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index or 0] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids)
