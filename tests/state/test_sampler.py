"""ResumableSampler: order = f(seed, epoch), exact mid-epoch resume, disjoint rank shards."""

from __future__ import annotations

import pytest
import torch

from runner.errors import ConfigError, IntegrityError
from runner.state.sampler import ResumableSampler


def _take(sampler: ResumableSampler, n: int) -> list[list[int]]:
    return [sampler.next_batch() for _ in range(n)]


def test_order_is_a_function_of_seed_and_epoch_only() -> None:
    a = ResumableSampler(50, batch_size=5, seed=3)
    torch.manual_seed(123)
    first = a.epoch_order(2).tolist()
    torch.manual_seed(456)  # the global RNG plays no part
    b = ResumableSampler(50, batch_size=5, seed=3)
    assert b.epoch_order(2).tolist() == first
    assert sorted(first) == list(range(50))
    assert a.epoch_order(1).tolist() != first
    assert ResumableSampler(50, batch_size=5, seed=4).epoch_order(2).tolist() != first


def test_drawing_batches_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    _take(ResumableSampler(50, batch_size=5, seed=3), 12)
    assert torch.equal(torch.rand(2), expected)


def test_epochs_cover_the_data_and_drop_the_short_tail() -> None:
    sampler = ResumableSampler(23, batch_size=5, seed=0)
    assert sampler.batches_per_epoch == 4
    epoch0 = _take(sampler, 4)
    assert sampler.epoch == 1 and sampler.batch_in_epoch == 0  # rolled over eagerly
    flat = [i for batch in epoch0 for i in batch]
    assert len(set(flat)) == 20
    assert flat == sampler.epoch_order(0).tolist()[:20]
    assert _take(sampler, 1)[0] == sampler.epoch_order(1).tolist()[:5]


@pytest.mark.parametrize("consumed", [0, 1, 3, 4, 7, 11])
def test_resume_from_state_dict_continues_with_the_next_batch(consumed: int) -> None:
    straight = ResumableSampler(23, batch_size=5, seed=9)
    expected = _take(straight, 12)
    first = ResumableSampler(23, batch_size=5, seed=9)
    _take(first, consumed)
    state = first.state_dict()
    second = ResumableSampler(23, batch_size=5, seed=9)
    second.load_state_dict(state)
    assert (second.epoch, second.batch_in_epoch) == (consumed // 4, consumed % 4)
    assert _take(second, 12 - consumed) == expected[consumed:]


def test_iteration_yields_the_rest_of_the_current_epoch() -> None:
    sampler = ResumableSampler(20, batch_size=5, seed=1)
    sampler.next_batch()
    assert len(sampler) == 3
    rest = list(sampler)
    assert len(rest) == 3 and sampler.epoch == 1
    assert len(list(sampler)) == 4


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_slices_whose_union_is_the_global_batch(world_size: int) -> None:
    single = ResumableSampler(60, batch_size=2 * world_size, seed=5)
    ranks = [
        ResumableSampler(60, batch_size=2, seed=5, world_size=world_size, rank=r)
        for r in range(world_size)
    ]
    for _ in range(single.batches_per_epoch):
        shards = [r.next_batch() for r in ranks]
        flat = [i for shard in shards for i in shard]
        assert len(set(flat)) == len(flat)
        assert flat == single.next_batch()


def test_world_size_change_mid_epoch_neither_repeats_nor_skips_samples() -> None:
    # 2 ranks x 3 for 3 steps (18 samples), then 3 ranks x 3: continues at sample 18 exactly.
    old = [ResumableSampler(90, batch_size=3, seed=2, world_size=2, rank=r) for r in range(2)]
    seen = [i for _ in range(3) for r in old for i in r.next_batch()]
    state = old[0].state_dict()
    new = [ResumableSampler(90, batch_size=3, seed=2, world_size=3, rank=r) for r in range(3)]
    for sampler in new:
        sampler.load_state_dict(state)
    assert new[0].batch_in_epoch == 2  # 18 samples = 2 global batches of 9
    while new[0].epoch == 0:
        seen += [i for r in new for i in r.next_batch()]
    order = ResumableSampler(90, batch_size=3, seed=2).epoch_order(0).tolist()
    assert seen == order[: len(seen)]
    assert len(seen) == 18 + (90 - 18) // 9 * 9


def test_state_of_another_dataset_or_seed_is_refused() -> None:
    state = ResumableSampler(20, batch_size=5, seed=1).state_dict()
    with pytest.raises(ConfigError, match=r"seed=1.*seed=2"):
        ResumableSampler(20, batch_size=5, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"num_samples=20.*num_samples=25"):
        ResumableSampler(25, batch_size=5, seed=1).load_state_dict(state)
    with pytest.raises(IntegrityError, match="malformed"):
        ResumableSampler(20, batch_size=5, seed=1).load_state_dict({"version": 1})
    with pytest.raises(IntegrityError, match="out of range"):
        ResumableSampler(20, batch_size=5, seed=1).load_state_dict({**state, "sample_offset": 99})


def test_bad_construction_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="smaller than one global batch"):
        ResumableSampler(5, batch_size=3, seed=0, world_size=2)
    with pytest.raises(ConfigError, match="rank"):
        ResumableSampler(50, batch_size=3, seed=0, world_size=2, rank=2)
    with pytest.raises(ConfigError, match="batch_size"):
        ResumableSampler(50, batch_size=0, seed=0)


def test_unshuffled_order_is_sequential() -> None:
    sampler = ResumableSampler(10, batch_size=3, seed=0, shuffle=False)
    assert _take(sampler, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_works_as_a_dataloader_batch_sampler_and_resumes_mid_epoch() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(30) * 10)
    sampler = ResumableSampler(30, batch_size=4, seed=8)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=0)
    straight = [b[0].tolist() for _ in range(2) for b in loader]  # two epochs of 7 batches
    assert len(straight) == 14 and sampler.epoch == 2

    first = ResumableSampler(30, batch_size=4, seed=8)
    it = iter(torch.utils.data.DataLoader(data, batch_sampler=first, num_workers=0))
    head = [next(it)[0].tolist() for _ in range(3)]
    second = ResumableSampler(30, batch_size=4, seed=8)
    second.load_state_dict(first.state_dict())
    loader = torch.utils.data.DataLoader(data, batch_sampler=second, num_workers=0)
    assert len(loader) == 4
    tail = [b[0].tolist() for b in loader] + [b[0].tolist() for b in loader]
    assert head + tail == straight


def test_set_epoch_keeps_a_mid_epoch_position_and_jumps_otherwise() -> None:
    sampler = ResumableSampler(20, batch_size=5, seed=1)
    sampler.next_batch()
    sampler.set_epoch(0)
    assert (sampler.epoch, sampler.sample_offset) == (0, 5)
    sampler.set_epoch(3)
    assert (sampler.epoch, sampler.sample_offset, sampler.batch_in_epoch) == (3, 0, 0)
