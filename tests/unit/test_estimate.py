"""The estimate of a run's time (train/estimate.py): its arithmetic and its words."""
import time

import pytest

from multigpu.train.estimate import Estimate, FirstSteps, compared, duration, spread


def test_an_epoch_is_its_steps_evaluation_and_checkpoint_and_the_job_its_epochs():
    e = Estimate(0.12, 0.06, 20, 4, True, batches=313, epochs=50, eval_s=2.0, checkpoint_s=1.0,
                 leaves_out=("start-up", "a cold page cache"))
    assert e.epoch_s == pytest.approx(313 * 0.12 + 3.0)
    assert e.total_s == pytest.approx(50 * (313 * 0.12 + 3.0))
    assert e.device_hours() == pytest.approx(4 * 50 * (313 * 0.12 + 3.0) / 3600)
    assert e.line() == ("~40.6 s an epoch of 313 steps (training 37.6 s, evaluation 2 s, checkpoint "
                        "1 s), ~33.8 min for 50 epochs, 2.25 GPU-hours on 4 GPUs (from 20 measured "
                        "steps, ±6 %); not in it: start-up, a cold page cache")


def test_without_the_epoch_s_steps_it_is_per_step_and_without_epochs_per_epoch():
    assert Estimate(0.1234, 0.04, 19, 2, False).line() == "~123 ms a step (from 19 measured steps, ±4 %)"
    assert Estimate(0.5, 0.0, 3, 1, False, batches=10).line() == (
        "~5 s an epoch of 10 steps (training 5 s) (from 3 measured steps, ±0 %)")
    assert "on 1 CPU process (" in Estimate(0.5, 0.0, 3, 1, False, batches=10, epochs=2).line()
    assert "on 3 CPU processes (" in Estimate(0.5, 0.0, 3, 3, False, batches=10, epochs=2).line()


@pytest.mark.parametrize("seconds, said", [(0.1234, "0.123 s"), (4.04, "4.04 s"), (41.44, "41.4 s"),
                                           (89.4, "89.4 s"), (100, "1.67 min"), (2040, "34 min"),
                                           (5.2 * 3600, "5.2 h"), (3.1 * 86400, "3.1 days"),
                                           (1234.5 * 86400, "1234 days")])
def test_durations_are_said_to_3_significant_figures(seconds, said):
    assert duration(seconds) == said


def test_the_spread_is_the_standard_error_of_the_mean_over_the_mean():
    assert spread([1.0]) == 0.0
    assert spread([0.9, 1.1, 0.9, 1.1]) == pytest.approx(0.11547 / 2, rel=1e-3)


def test_the_closing_comparison_says_how_far_off_the_estimate_was():
    assert compared(35.0, 37.2, 3) == ("estimate: the 3 epochs took 37.2 s, estimated ~35 s (6 % longer "
                                       "than estimated)")
    assert compared(100.0, 80.0, 1) == ("estimate: the 1 epoch took 80 s, estimated ~1.67 min (20 % "
                                        "shorter than estimated)")
    assert compared(5.0, 5.01, 2) == "estimate: the 2 epochs took 5.01 s, estimated ~5 s (as estimated)"


def test_a_run_of_under_5_seconds_is_not_compared_with_its_estimate():
    assert compared(0.0594, 0.147, 1) == ("estimate: the 1 epoch took 0.147 s, estimated ~0.0594 s "
                                          "(under 5 s: too short a run to compare)")
    assert compared(4.0, 4.99, 2).endswith("(under 5 s: too short a run to compare)")


def test_first_steps_skip_the_first_batches_and_wait_for_the_device_only_at_the_window_s_ends():
    syncs = []
    timer = FirstSteps(100, skip=5, measure=8, group=2, seconds=0.0, sync=lambda: syncs.append(True))
    done = []
    for batches in range(1, 40):
        time.sleep(0.01 if batches <= 5 else 0.004)  # the first five are slow (the loader's start)
        done.append(timer.after(batches))
    assert done.count(True) == 1 and done.index(True) == 12  # after batch 13 = 5 skipped + 8 timed
    assert len(syncs) == 2
    assert len(timer.samples) == 4 and timer.measured == 8
    assert 0.004 <= timer.step_s < 0.008


def test_the_window_lasts_its_seconds_or_to_the_epoch_s_last_batch_but_one():
    timer = FirstSteps(200, skip=5, measure=4, group=2, seconds=0.1)
    done = [timer.after(b) or time.sleep(0.005) for b in range(1, 200)]
    assert done.count(True) == 1 and 4 < timer.measured < 194  # 4 batches were too short
    assert timer.step_s * timer.measured >= 0.1
    short = FirstSteps(12, skip=5, measure=20, seconds=0.0)
    assert [b for b in range(1, 13) if short.after(b)] == [11] and short.measured == 9


def test_an_epoch_of_one_batch_is_not_timed():
    timer = FirstSteps(1)
    assert not timer.enough and not timer.after(1)
