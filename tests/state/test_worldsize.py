"""Resume at another world size (simulated ranks): step rescaled, samples_seen exact, logged."""

from __future__ import annotations

import logging

import pytest

from runner.demo.components import DemoComponents, build_demo
from runner.errors import ConfigError
from runner.state.train_state import Counters
from runner.state.worldsize import position_from_samples_seen, rescale_counters, rescale_step

SETTINGS = {"seed": 1, "device": "cpu", "batch_size": 4, "total_steps": 40, "max_samples": 40}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _demo(*, world_size: int = 1, rank: int = 0) -> DemoComponents:
    return build_demo(**SETTINGS, world_size=world_size, rank=rank)


@pytest.mark.parametrize(
    ("step", "old", "new", "expected"),
    [(30, 1, 2, 15), (30, 2, 1, 60), (30, 4, 3, 40), (31, 1, 2, 15), (7, 3, 3, 7)],
)
def test_rescale_step_follows_the_seed_rule(step: int, old: int, new: int, expected: int) -> None:
    assert rescale_step(step, old_world_size=old, new_world_size=new) == expected


def test_rescale_refuses_nonsense_world_sizes() -> None:
    with pytest.raises(ConfigError, match="world sizes must be >= 1"):
        rescale_step(3, old_world_size=1, new_world_size=0)


def test_rescale_counters_keeps_samples_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    counters = Counters(step=31, epoch=2, batch_in_epoch=3, samples_seen=992, world_size=4)
    with caplog.at_level(logging.WARNING, logger="runner.state.worldsize"):
        new, change = rescale_counters(counters, new_world_size=8)
    assert new == Counters(step=15, epoch=2, batch_in_epoch=3, samples_seen=992, world_size=8)
    assert change is not None and change.new_step == 15
    assert (
        "world size changed 4 -> 8: step rescaled 31 -> 15 (step x 4 / 8, floor of 15.5); "
        "samples_seen 992 kept exactly"
    ) in caplog.text
    same, none = rescale_counters(counters, new_world_size=4)
    assert same is counters and none is None


def test_position_from_samples_seen() -> None:
    # 23 samples, global batch 5: 20 used per epoch.
    assert position_from_samples_seen(0, num_samples=23, global_batch_size=5) == (0, 0)
    assert position_from_samples_seen(45, num_samples=23, global_batch_size=5) == (2, 5)
    with pytest.raises(ConfigError, match="does not fit"):
        position_from_samples_seen(5, num_samples=4, global_batch_size=5)


def test_resume_from_one_rank_on_two_rescales_step_schedule_and_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    single = _demo()
    for _ in range(13):  # 13 steps x 4 samples = 52 = epoch 1 (40 per epoch), sample 12
        single.train_step()
    state = single.capture()

    ranks = [_demo(world_size=2, rank=r) for r in range(2)]
    with caplog.at_level(logging.WARNING):
        restored = [r.restore(state) for r in ranks]
    assert restored[0] == Counters(step=6, epoch=1, batch_in_epoch=1, samples_seen=52, world_size=2)
    assert restored[1] == restored[0]
    assert "world size changed 1 -> 2: step rescaled 13 -> 6" in caplog.text
    assert ranks[0].scheduler.last_epoch == 6
    factor = ranks[0].scheduler.lr_lambdas[0](6)
    assert ranks[0].optimizer.param_groups[0]["lr"] == pytest.approx(ranks[0].config.lr * factor)
    # the demo stretches the schedule to the run's length at this size: one line, its value
    assert "LR schedule moved" not in caplog.text
    with caplog.at_level(logging.WARNING):
        ranks[0].rescale_schedule(ranks[0].config.total_steps // 2)
    moved = [r.getMessage() for r in caplog.records if "LR schedule moved" in r.getMessage()]
    lr = ranks[0].optimizer.param_groups[0]["lr"]
    assert moved == [
        f"LR schedule moved to step 6 (stretched to {ranks[0].config.total_steps} steps at this "
        f"world size): lr=[{lr!r}]"
    ]

    # Data continues at sample 12 of epoch 1 exactly, split between the two ranks.
    order = single.sampler.epoch_order(1).tolist()
    assert ranks[0].sampler.next_batch() + ranks[1].sampler.next_batch() == order[12:20]


def test_resume_without_sampler_position_derives_it_from_samples_seen() -> None:
    single = _demo()
    for _ in range(13):
        single.train_step()
    state = single.capture()
    state["sampler"] = {}  # e.g. converted from a seed .bin file
    resumed = _demo()
    counters = resumed.restore(state)
    assert (counters.epoch, counters.batch_in_epoch, counters.step) == (1, 3, 13)
    assert resumed.sampler.next_batch() == single.sampler.next_batch()


def test_sampler_sharded_for_another_world_size_is_refused() -> None:
    single = _demo()
    state = single.capture()
    resumed = _demo(world_size=2)
    with pytest.raises(ConfigError, match="sharded for world_size=2"):
        from runner.state.train_state import restore_train_state

        restore_train_state(
            state,
            model=resumed.model,
            optimizer=resumed.optimizer,
            sampler=resumed.sampler,
            world_size=1,
        )


def test_world_size_change_without_sampler_position_uses_the_saved_global_batch() -> None:
    # Saved at 1 rank x 4: 52 samples = epoch 1, sample 12 (40 per epoch). Resumed on 2 ranks,
    # the position must come from the saved global batch (4), not the new one (8).
    single = _demo()
    for _ in range(13):
        single.train_step()
    state = single.capture()
    state["sampler"] = {}
    ranks = [_demo(world_size=2, rank=r) for r in range(2)]
    counters = [r.restore(state) for r in ranks]
    assert (counters[0].step, counters[0].epoch, counters[0].samples_seen) == (6, 1, 52)
    assert counters[1] == counters[0]
    order = single.sampler.epoch_order(1).tolist()
    assert ranks[0].sampler.next_batch() + ranks[1].sampler.next_batch() == order[12:20]


def test_a_plain_module_state_logs_its_schedule_move_once_with_the_value_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch

    from runner.state.train_state import ModuleTrainState

    def state(world_size: int) -> ModuleTrainState:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return ModuleTrainState(model=model, optimizer=opt, scheduler=sched, world_size=world_size)

    single = state(1)
    for _ in range(8):
        single.optimizer.step()
        single.scheduler.step()
        single.advance(loss=0.0, samples=4)
    resumed = state(2)
    with caplog.at_level(logging.WARNING):
        resumed.restore(single.capture())
    moved = [r.getMessage() for r in caplog.records if "LR schedule moved" in r.getMessage()]
    assert moved == ["LR schedule moved to step 4: lr=[0.2]"]
    assert resumed.optimizer.param_groups[0]["lr"] == 0.2
