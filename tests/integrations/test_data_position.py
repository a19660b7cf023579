"""runner.integrations.data_position on a real shuffling DataLoader: a loader resumed after K
batches yields the batches an uninterrupted epoch yields after its K-th, and leaves the global
RNG where the checkpoint had it; without the position, the resumed epoch's order differs."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.integrations.data_position import Position, make_resumable
from runner.state.rng import capture_rng, restore_rng

K = 3


def _loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    return DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True)


def _epoch_then_checkpoint() -> tuple[list[list[int]], Position, dict[str, object], float]:
    """An uninterrupted epoch: its batches, the position and RNG after K of them (a training
    step draws from the RNG in between), and the draw right after the K-th step."""
    torch.manual_seed(11)
    trained = 0
    loader = make_resumable(_loader(), trained=lambda: trained)
    batches, position, rng, draw = [], None, None, 0.0
    for i, (batch,) in enumerate(loader):
        batches.append(batch.tolist())
        torch.rand(1)  # dropout, say
        trained = i + 1
        if trained == K:
            position, rng = loader.position(), capture_rng()
            draw = torch.rand(1).item()
            restore_rng(rng)
    assert position is not None and rng is not None
    return batches, position, rng, draw


def test_a_resumed_loader_continues_the_epoch_and_the_rng() -> None:
    batches, position, rng, draw = _epoch_then_checkpoint()
    assert position.trained == K
    torch.manual_seed(999)  # the new process draws whatever before the resume
    torch.rand(5)
    loader = make_resumable(_loader(), trained=lambda: 0)
    loader.resume_at(position)
    restore_rng(rng)  # what the integration restores from the checkpoint
    it = iter(loader)
    first = next(it)[0].tolist()
    assert torch.rand(1).item() == draw  # training draws what it would have drawn
    rest = [first] + [b.tolist() for (b,) in it]
    assert rest == batches[K:]


def test_without_the_position_the_resumed_epoch_differs() -> None:
    batches, _, rng, _ = _epoch_then_checkpoint()
    restore_rng(rng)
    plain = [b.tolist() for (b,) in _loader()]
    assert plain[: len(batches) - K] != batches[K:]
