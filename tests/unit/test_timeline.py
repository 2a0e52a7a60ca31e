import pytest

from multigpu.train.rundir import timeline
from multigpu.train.rundir.timeline import Timeline, command_start, mark_command_start


class Clock:
    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock(1000.0)
    monkeypatch.setattr(timeline, "time", fake)
    return fake


def test_the_start_up_splits_into_launch_imports_and_the_parts_marked_in_order(clock):
    job = Timeline(started=995.0, process=998.0)  # the launcher took 3 s, imports 2 s
    clock.now += 0.25
    job.mark("data")
    clock.now += 0.5
    job.mark("model")
    clock.now += 0.5
    job.mark("data")  # a part marked twice adds up
    job.mark_ready("logs")
    job.add("training", 1.0)
    assert job.starting == {"launch": 3.0, "imports": 2.0, "data": 0.75, "model": 0.5, "logs": 0.0}
    assert job.summary(now=clock.now + 1.5) == (
        "time: 7.8 s since the command: 6.2 s starting (launch 3.0, imports 2.0, data 0.8, model 0.5, "
        "logs 0.0), 1.0 s training, 0.0 s evaluating, 0.0 s held up by checkpoints, 0.5 s other "
        "(metrics, plot)")


def test_the_launch_splits_where_the_launcher_handed_over_to_the_agent(clock):
    """launcher: its imports (torch's for torchrun) and checks; workers' start: the rendezvous,
    the processes' and Python's start. Not after a restart, whose agent start is the first's."""
    assert Timeline(started=995.0, process=998.0, agent=996.5).starting == {
        "launcher": 1.5, "workers' start": 1.5, "imports": 2.0}
    assert Timeline(started=995.0, process=998.0, agent=996.5, restarts=1).starting == {
        "launch and 1 earlier attempt": 3.0, "imports": 2.0}
    assert Timeline(started=995.0, process=998.0, agent=990.0).starting == {  # another launch's
        "launch": 3.0, "imports": 2.0}
    env = {timeline.AGENT_STARTED_ENV: "996.5"}
    assert timeline.agent_start(env) == 996.5 and timeline.agent_start({}) is None


def test_the_command_s_own_process_counts_no_launch_and_one_without_a_command_starts_now(clock):
    assert Timeline(started=999.0, process=999.0).starting == {"imports": 1.0}
    assert Timeline(started=990.0, process=998.0, restarts=2).starting == {
        "launch and 2 earlier attempts": 8.0, "imports": 2.0}
    env = {}
    assert command_start(env) is None
    mark_command_start(123.5, env)
    assert command_start(env) == 123.5
    alone = Timeline(started=None)
    assert (alone.started, alone.starting) == (1000.0, {})


def test_parts_done_in_a_thread_follow_the_marked_ones_naming_what_they_overlapped(clock):
    """The marked parts still add up to the start-up; a thread's parts (head_start.py) come after
    them, each with the marked parts it overlapped by at least the line's rounding."""
    job = Timeline(started=998.0, process=999.0)
    job.mark("process group")                 # 1000.0 - 1000.0: a part of no time
    clock.now += 2.0
    job.mark("data")                          # 1000.0 - 1002.0
    clock.now += 1.0
    job.mark_ready("model")                   # 1002.0 - 1003.0
    job.meanwhile("decoder", 1000.0, 1001.5)
    job.meanwhile("folder listing", 1001.5, 1002.02)
    job.meanwhile("compiler", 1001.9, 1003.0)
    assert job.summary(now=clock.now) == (
        "time: 5.0 s since the command: 5.0 s starting (launch 1.0, imports 1.0, process group 0.0, "
        "data 2.0, model 1.0; meanwhile in a thread: decoder 1.5 during data, folder listing 0.5 "
        "during data, compiler 1.1 during data + model), 0.0 s training, 0.0 s evaluating, 0.0 s "
        "held up by checkpoints, 0.0 s other (metrics, plot)")
    assert Timeline(started=999.0)._during(1.0, 2.0) == ""  # nothing marked: nothing to name


def test_the_first_optimizer_step_is_said_counted_from_the_command(clock):
    job = Timeline(started=998.0, process=999.0)
    job.mark_ready("logs")
    clock.now += 1.3
    job.stepped()
    clock.now += 1.0
    job.stepped()  # only the first counts
    job.add("training", 2.0)
    assert job.summary(now=clock.now) == (
        "time: 4.3 s since the command: 2.0 s starting (launch 1.0, imports 1.0, logs 0.0), first "
        "step done at 3.3 s, 2.0 s training, 0.0 s evaluating, 0.0 s held up by checkpoints, 0.3 s "
        "other (metrics, plot)")


def test_the_first_step_says_how_long_the_loop_waited_for_its_batch(clock):
    """The wait for the first step's batches (the loader's workers starting) is said beside the
    first step: only the first call counts, as for the step."""
    job = Timeline(started=998.0, process=999.0)
    job.mark_ready("logs")
    clock.now += 2.5
    job.stepped()
    job.waited_first(1.84)
    job.waited_first(0.2)  # a later step's: not the first
    job.add("training", 2.5)
    assert job.summary(now=clock.now) == (
        "time: 4.5 s since the command: 2.0 s starting (launch 1.0, imports 1.0, logs 0.0), first "
        "step done at 4.5 s (1.8 s waiting for data), 2.5 s training, 0.0 s evaluating, 0.0 s "
        "held up by checkpoints, 0.0 s other (metrics, plot)")
