"""Naming the rank that holds the others back (core/stragglers.py): the judgement on the ranks'
figures of an epoch, and the two epochs in a row it needs."""
from multigpu.core.stragglers import Judge, ranks_record, slowest


def figures(*own):
    """Ranks with (data_ms, compute_ms) each."""
    return [{"rank": r, "host": "a" if r < 2 else "b", "device": f"GPU {r % 2}", "data_ms": d,
             "compute_ms": c} for r, (d, c) in enumerate(own)]


def test_a_rank_over_a_quarter_slower_in_compute_is_named_with_what_the_others_wait():
    slow = slowest(figures((0.1, 30.0), (0.1, 30.5), (0.1, 40.0), (0.1, 29.5)))
    assert (slow["rank"], slow["kind"]) == (2, "compute")
    assert round(slow["over"], 3) == round(40 / 30 - 1, 3)
    assert round(slow["wait_ms"], 1) == 10.0  # 40.1 over the others' median, 30.1
    assert Judge().epoch(figures((0.1, 30.0), (0.1, 40.0))) is None  # one epoch is not enough


def test_the_second_epoch_in_a_row_names_it_and_each_one_after_while_it_stays_slow():
    judge, slow = Judge(), figures((0.1, 30.0), (0.1, 30.0), (0.1, 30.0), (0.1, 40.0))
    assert judge.epoch(slow) is None
    assert judge.epoch(slow) == ("rank 3 (host b, GPU 1) computes 33 % slower than the others: "
                                 "they wait 10 ms a step for it")
    assert judge.epoch(slow) is not None
    assert judge.epoch(figures((0.1, 30.0), (0.1, 30.0), (0.1, 30.0), (0.1, 30.0))) is None
    assert judge.epoch(slow) is None  # a new run of slow epochs: two again


def test_another_rank_slow_in_the_next_epoch_is_not_named():
    judge = Judge()
    assert judge.epoch(figures((0.1, 40.0), (0.1, 30.0))) is None
    assert judge.epoch(figures((0.1, 30.0), (0.1, 40.0))) is None


def test_a_rank_waiting_for_its_data_is_named_as_such():
    judge, slow = Judge(), figures((0.2, 10.0), (25.0, 10.0), (0.3, 10.0))
    judge.epoch(slow)
    assert judge.epoch(slow) == ("rank 1 (host a, GPU 1) waits 25 ms a step for its data, the "
                                 "others 0.2 ms: they wait 25 ms a step for it")


def test_below_a_quarter_or_under_5_ms_a_step_is_noise():
    assert slowest(figures((0.1, 100.0), (0.1, 124.0))) is None  # 24 %
    assert slowest(figures((0.1, 1.0), (0.1, 5.9))) is None      # 490 %, but 4.9 ms
    assert slowest(figures((0.1, 1.0), (0.1, 6.2)))["kind"] == "compute"


def test_many_times_as_long_is_said_so_and_the_epoch_s_record_holds_every_rank():
    judge, slow = Judge(), figures((0.1, 2.0), (0.1, 22.0))
    judge.epoch(slow)
    said = judge.epoch(slow)
    assert said == "rank 1 (host a, GPU 1) computes 11.0x as long as the others: they wait 20 ms a step for it"
    assert ranks_record((slow, said)) == {"ranks": slow, "straggler": said}
    assert ranks_record((slow, None)) == {"ranks": slow} and ranks_record(None) == {}
