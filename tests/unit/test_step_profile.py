"""MULTIGPU_PROFILE_STEPS: the window read from the environment, and the numbers a trace's
kernels give (the whole run's profile: tests/multiproc/test_logs.py)."""
import json

import pytest

from multigpu.core.errors import UsageError
from multigpu.train.rundir import step_profile


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


class _Env:
    def all_gather_object(self, obj):
        return [obj]


class _Rt:
    """One CPU process: the profiler's own ways to the run (rank 0 unless told)."""

    def __init__(self, rank=0, accumulate=1):
        import torch

        self.device, self.rank, self.is_main = torch.device("cpu"), rank, rank == 0
        self.accumulate, self.env = accumulate, _Env()


def _steps(profile, steps, accumulate=1):
    """The optimizer steps of a run of `steps` batches, as trainloop calls after_step."""
    for step in range(accumulate, steps + 1, accumulate):
        profile.after_step(step, 0.0)


def _profiled_steps(out) -> tuple[int, int]:
    """(first, last) step of the profile rank 0 wrote under `out`."""
    numbers = json.loads((out / "profile" / "rank0.json").read_text())
    return numbers["first"], numbers["last"]


def test_a_window_of_batches_between_the_optimizer_steps_of_accumulate_is_profiled(tmp_path):
    """--accumulate 2: after_step comes at steps 2, 4, 6, ...; steps 6-7 are in the optimizer
    steps that end at 6 and 8. The whole of those is profiled and said as the steps it holds."""
    profile = step_profile.StepProfile((6, 7), tmp_path, _Rt(accumulate=2))
    _steps(profile, 12, accumulate=2)
    profile.close()
    assert profile.done
    assert _profiled_steps(tmp_path) == (5, 8)


def test_a_window_from_the_first_step_is_profiled(tmp_path):
    """Steps 1-3: the profiler starts before the first step (no step 0 comes to start it after)."""
    profile = step_profile.StepProfile((1, 3), tmp_path, _Rt())
    profile.begin(0)
    _steps(profile, 5)
    assert profile.done
    assert _profiled_steps(tmp_path) == (1, 3)


def test_a_run_resumed_just_before_its_window_profiles_it(tmp_path):
    """A resume from step 99 trains step 100 first: the window 100-102 is all in this run."""
    profile = step_profile.StepProfile((100, 102), tmp_path, _Rt())
    profile.begin(99)
    for step in range(100, 105):
        profile.after_step(step, 0.0)
    assert profile.done
    assert _profiled_steps(tmp_path) == (100, 102)


def test_a_rank_that_keeps_no_trace_leaves_no_file_and_no_open_descriptor(tmp_path, monkeypatch):
    import os
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    profile = step_profile.StepProfile((2, 3), tmp_path / "run", _Rt(rank=1))
    open_before = len(os.listdir("/proc/self/fd"))
    _steps(profile, 4)
    assert profile.done
    assert len(os.listdir("/proc/self/fd")) == open_before
    assert list((tmp_path / "tmp").iterdir()) == []
    assert sorted(p.name for p in (tmp_path / "run" / "profile").iterdir()) == ["rank1.json"]


def test_kernel_times_are_those_of_the_busiest_gpu_when_one_process_drives_several():
    """--strategy dp: one process, its trace holds every GPU's kernels (the trace's pid is the
    device). GPU 0 busy 0-300 on stream 7; GPU 1 busy 300-600 on its own stream 7 and a copy on
    stream 9: GPU 0 is not busy while GPU 1 is, and GPU 1's streams are not GPU 0's others."""
    events = [{**_span("conv", 0, 300, 7), "pid": 0}, {**_span("conv", 300, 500, 7), "pid": 1},
              {**_span("Memcpy", 500, 600, 9, cat="gpu_memcpy"), "pid": 1}]
    times = step_profile.kernel_times(events, steps=1)
    assert times == {"gpu_busy_ms": pytest.approx(0.3), "training_stream_ms": pytest.approx(0.3),
                     "other_streams_ms": 0, "nccl_ms": 0, "nccl_exposed_ms": 0, "kernels_per_step": 1}


def test_a_window_over_an_epochs_end_counts_the_wait_of_both_epochs_and_says_it_holds_the_end(tmp_path, capsys):
    """Steps 3-6 of 4-step epochs: the cursor's wait restarts with epoch 2 (0.5 s waited before the
    window, 0.7 s at epoch 1's end, 0.1 s in epoch 2): 0.3 s over the 4 steps, not 0.1 - 0.5 < 0."""
    profile = step_profile.StepProfile((3, 6), tmp_path, _Rt())
    for step, waited, epoch in [(1, 0.2, 1), (2, 0.5, 1), (3, 0.6, 1), (4, 0.7, 1), (5, 0.05, 2), (6, 0.1, 2)]:
        profile.after_step(step, waited, epoch)
    numbers = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    assert numbers["waiting_for_data_ms"] == pytest.approx(300 / 4)
    assert numbers["epoch_ends"] == 1
    said = capsys.readouterr()
    assert ("the window holds the end of an epoch (its evaluation and checkpoint): profile steps "
            "within one epoch for a step's own time") in said.out + said.err
