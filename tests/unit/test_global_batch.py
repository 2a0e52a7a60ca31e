"""setup(global_batch_size=G) / --global-batch-size G: the micro-batch and accumulation chosen from
the devices, a G that cannot be made refused naming the nearest that can, and the optimizer steps
(which positions of the epoch's order each trains, the last smaller one too) the same on any
device count."""
from __future__ import annotations

import pytest

from multigpu.core.errors import UsageError
from multigpu.core.loading.global_batch import BatchPlan, nearest_working, plan_batch
from multigpu.core.loading.global_batch_sampler import GlobalBatchSampler
from multigpu.train.settings.flagwords import say
from multigpu.train.settings.optim_config import OptimConfig


@pytest.mark.parametrize("devices, largest, micro, accumulate", [
    (1, 64, 48, 1), (2, 64, 24, 1), (3, 8, 8, 2), (4, 4, 4, 3), (8, 64, 6, 1), (2, 10, 8, 3)])
def test_the_largest_micro_batch_that_divides_the_share_and_accumulation_for_the_rest(
        devices, largest, micro, accumulate):
    assert plan_batch(48, devices, largest) == BatchPlan(48, devices, micro, accumulate, largest)


def test_a_global_batch_the_devices_cannot_share_evenly_is_refused_with_the_nearest_that_work():
    with pytest.raises(UsageError) as caught:
        plan_batch(50, 4, 64)
    assert say(caught.value) == ("--global-batch-size 50 cannot be shared out evenly over this "
                                 "run's 4 devices (each takes the same number of samples): give "
                                 "--global-batch-size 48 or --global-batch-size 52")
    assert str(caught.value).startswith("setup(global_batch_size=50) cannot be shared out")


def test_a_share_that_splits_only_into_tiny_micro_batches_is_refused_with_the_nearest_that_work():
    # 68 on 4 is 17 per device: 17 micro-batches of 1 where 16 fit (17 x the steps' time)
    with pytest.raises(UsageError) as caught:
        plan_batch(68, 4, 16)
    assert say(caught.value) == ("--global-batch-size 68 is 17 samples per device on 4 devices, "
                                 "which splits only into 17 micro-batches of 1 where --batch-size "
                                 "allows 16: give --global-batch-size 64 or --global-batch-size 72")
    assert nearest_working(3, 4, 64) == [4]  # none below the device count


def test_accumulate_beside_a_global_batch_is_refused_in_one_line():
    with pytest.raises(UsageError) as caught:
        OptimConfig(accumulate=2, global_batch_size=48)
    assert say(caught.value) == ("--accumulate 2 and --global-batch-size 48 both set the "
                                 "accumulation: give --global-batch-size 48 alone (it chooses the "
                                 "accumulation from the devices)")


def _optimizer_steps(n: int, global_batch: int, devices: int, largest: int, *, start: int = 0,
                     drop_last: bool = False) -> list[list[int]]:
    """The positions each optimizer step trains, over all ranks, and a check that every rank
    runs the same steps with the loss weighted by the step's real samples."""
    plan = plan_batch(global_batch, devices, largest)
    ranks = []
    for rank in range(devices):
        sampler = GlobalBatchSampler(global_batch, n, plan.micro, num_ranks=devices, rank=rank,
                                     drop_last=drop_last)
        sampler.set_epoch(0, start)
        ranks.append((list(sampler), sampler.step_infos()))
    syncs = {tuple(i.sync for i in infos) for _, infos in ranks}
    assert len(syncs) == 1, "every rank steps the optimizer at the same micro-steps"
    steps, current = [], []
    for k, info in enumerate(ranks[0][1]):
        current += [i for batches, _ in ranks for i in batches[k]]
        if info.sync:
            assert info.window_count == len(current)
            steps.append(sorted(current))
            current = []
    return steps


@pytest.mark.parametrize("n, drop_last", [(120, False), (130, False), (131, True), (25, False)])
def test_each_optimizer_step_trains_the_same_positions_on_2_3_4_and_8_devices(n, drop_last):
    one = _optimizer_steps(n, 24, 1, 24, drop_last=drop_last)
    for devices, largest in [(2, 4), (3, 8), (4, 64), (8, 1)]:
        assert _optimizer_steps(n, 24, devices, largest, drop_last=drop_last) == one, devices


def test_the_last_smaller_step_joins_the_one_before_whatever_the_device_count():
    # 130 = 5 x 24 + 10: the last 10 cannot be a step of their own on 8 devices (fewer than 2 each)
    for devices in (1, 2, 4, 8):
        steps = _optimizer_steps(130, 24, devices, 64)
        assert [len(s) for s in steps] == [24, 24, 24, 24, 34], devices
    assert [len(s) for s in _optimizer_steps(130, 24, 4, 64, drop_last=True)] == [24] * 5


def test_a_resume_on_another_device_count_trains_the_steps_an_uninterrupted_epoch_would():
    whole = _optimizer_steps(130, 24, 4, 3)
    for devices in (2, 3):
        assert _optimizer_steps(130, 24, devices, 64, start=48) == whole[2:], devices
