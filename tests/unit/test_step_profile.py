"""MULTIGPU_PROFILE_STEPS: the window read from the environment, and the numbers a trace's
kernels give (the whole run's profile: tests/multiproc/test_logs.py)."""
import pytest

from multigpu.core.errors import UsageError
from multigpu.train import step_profile


@pytest.mark.parametrize("text, window", [("100-119", (100, 119)), (" 7 ", (7, 7)), ("3 - 4", (3, 4)), ("", None)])
def test_the_window_is_read_from_the_environment(text, window):
    assert step_profile.window_from_env({step_profile.ENV: text}) == window


@pytest.mark.parametrize("text", ["0-3", "5-3", "ten", "1-2-3", "-4"])
def test_a_window_that_is_not_first_last_is_refused_in_one_line(text):
    with pytest.raises(UsageError) as caught:
        step_profile.window_from_env({step_profile.ENV: text})
    assert str(caught.value) == (f"MULTIGPU_PROFILE_STEPS={text}: give the steps to profile as "
                                 "FIRST-LAST, e.g. 100-119 (counted from the run's first step, 1)")


def _span(name, start, end, stream, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "args": {"stream": stream}}


def test_kernel_times_split_the_gpu_time_by_stream_and_all_reduce():
    """Two steps (µs): the training stream busy 0-300 and 400-700 (an all-reduce 600-800 on its
    own stream, 100 of it after the last computing kernel), a copy on a third stream 900-1000."""
    events = [_span("conv", 0, 300, 7), _span("bn", 400, 700, 7), _span("ncclAllReduce", 600, 800, 13),
              _span("Memcpy HtoD", 900, 1000, 21, cat="gpu_memcpy"),
              {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 5000}]
    times = step_profile.kernel_times(events, steps=2)
    assert times == {"gpu_busy_ms": pytest.approx(0.4), "training_stream_ms": pytest.approx(0.3),
                     "other_streams_ms": pytest.approx(0.15), "nccl_ms": pytest.approx(0.1),
                     "nccl_exposed_ms": pytest.approx(0.05), "kernels_per_step": 1.5}


def test_union_length_counts_overlaps_once():
    assert step_profile.union_length([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert step_profile.union_length([]) == 0
