"""--decode auto's trial: its windows, its rates and its pick (decode_choice)."""
import torch

from multigpu.train.data import decode_choice
from multigpu.train.data.decode_choice import Plan, pick, rates


def test_the_windows_leave_the_queued_batches_out_and_reverse_the_second_round():
    plan = Plan.for_loader((1.0, 0.0, 0.5), workers=2, prefetch_factor=4, finished_ahead=3)
    assert plan.lag == 2 * 4 + 1 + 3 + 1 and plan.steps == 13  # 3 finished ahead, 1 handed over
    assert Plan.for_loader((1.0, 0.0), workers=2, prefetch_factor=4, finished_ahead=0).lag == 2 * 4 + 1
    plan = Plan.for_loader((1.0, 0.0, 0.5), workers=2, prefetch_factor=4, finished_ahead=2)
    assert plan.lag == 2 * 4 + 1 + 3 and plan.steps == 12
    assert plan.order == [1.0, 0.0, 0.5, 0.5, 0.0, 1.0]
    events = plan.events()
    assert events[:3] == [(10, "switch", 0), (22, "start", 0), (34, "end", 0)]
    assert events[-1] == (plan.total, "end", 5) and plan.total == 10 + 6 * 24


def test_a_way_s_rate_is_the_lower_of_what_the_loop_took_and_the_workers_made():
    plan = Plan((1.0, 0.0), lag=1, steps=10, rounds=1)
    # cpu: 100 samples in 1 s taken, but its workers made one per 0.04 s on each of 2 ranks (50/s):
    # a queue left full by the way before; gpu: 80/s taken, the workers idle at 500/s
    windows = torch.tensor([[100.0, 1.0, 0.04], [80.0, 1.0, 0.004]], dtype=torch.float64)
    measured = rates(plan, windows, world_size=2)
    assert measured == {1.0: 50.0, 0.0: 80.0}
    assert pick(measured) == 0.0
    windows = torch.tensor([[100.0, 1.0, 0.01], [80.0, 1.0, 0.004]], dtype=torch.float64)
    assert pick(rates(plan, windows, world_size=2)) == 1.0


def test_the_candidates_are_the_workers_the_gpu_and_one_hybrid():
    assert decode_choice.candidate_shares(15) == (1.0, 0.0, 0.51)
    assert decode_choice.candidate_shares(1) == (1.0, 0.0, 0.5)  # the rule's 7 %: too little to tell
    assert [decode_choice.mode_name(s) for s in (1.0, 0.0, 0.51)] == ["cpu", "gpu", "hybrid 51%"]
