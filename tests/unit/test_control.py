"""Control: when to checkpoint inside an epoch, and stops on a signal (one process; the agreement
between ranks is exercised by the multi-process fault tests)."""
import os
import signal

import pytest

from multigpu.train.control import Cadence, Control, Decision
from multigpu.core.distributed import DistEnv
from multigpu.core.errors import UsageError


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("text,steps,seconds", [
    ("500", 500, None), ("30s", None, 30.0), ("10m", None, 600.0), ("1.5h", None, 5400.0),
    ("0", None, None), (" 2m ", None, 120.0)])
def test_cadence_parses_steps_times_and_off(text, steps, seconds):
    c = Cadence.parse(text)
    assert (c.steps, c.seconds) == (steps, seconds)


@pytest.mark.parametrize("text", ["10 minutes", "-5", "1.5", "m", ""])
def test_a_bad_cadence_says_what_is_accepted(text):
    with pytest.raises(UsageError, match=r"--checkpoint-every .*: (use a number of steps \(500\), "
                                         r"a time \(30s, 10m, 2h\)|a number of steps is a whole)"):
        Cadence.parse(text)


def test_step_cadence_saves_exactly_every_n_steps():
    control = Control(DistEnv(), Cadence(steps=3))
    saves = []
    for step in range(1, 11):
        if control.after_step(step) == Decision(True, None):
            saves.append(step)
            control.saved(step)
    assert saves == [3, 6, 9]


def test_time_cadence_saves_once_the_time_has_passed_since_the_last_save():
    clock = Clock()
    control = Control(DistEnv(), Cadence(seconds=600), clock=clock)
    clock.now += 599
    assert control.after_step(1) is None
    clock.now += 2
    assert control.after_step(2) == Decision(True, None)
    control.saved(2)
    clock.now += 300
    assert control.after_step(3) is None


def test_a_stop_request_means_save_and_stop_and_the_strongest_reason_wins():
    control = Control(DistEnv(), Cadence())
    assert control.after_step(1) is None
    control.request_stop("SIGTERM")
    control.request_stop("SIGINT")
    assert control.after_step(2) == Decision(True, "SIGTERM")


def test_the_first_signal_asks_for_a_stop_the_second_stops_at_once(capsys):
    control = Control(DistEnv(), Cadence())
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    with control.signal_handlers():
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C
        assert control.stop_requested == "SIGINT"
        assert ("SIGINT: the ranks stop together at their next exchange (about a second of steps), "
                "then save a checkpoint") in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    signal.signal(signal.SIGINT, before)


SAME_STOP = """
import os, signal, sys, time
from multigpu.core.distributed import DistEnv
from multigpu.train import control as c
stops = c.Control(DistEnv(), c.Cadence())
with stops.signal_handlers():
    os.kill(os.getpid(), signal.SIGTERM)  # the job manager's, to this rank
    os.kill(os.getpid(), signal.SIGTERM)  # the launcher's copy
    print(stops.stop_requested, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # one more: at once
    print("still here", flush=True)
"""


@pytest.mark.parametrize("forwarded", [True, False])
def test_the_launcher_s_copy_of_a_stop_signal_is_the_same_stop_and_one_more_stops_at_once(tmp_path, forwarded):
    """SIGTERM to every process of a job reaches a rank twice, its own and the launcher's copy,
    which the launcher said in the attempt's folder (stop_reason.mark_forwarded): one stop, one
    warning, and the next SIGTERM ends the process at once. Where the launcher passed nothing on,
    the second one does."""
    import subprocess
    import sys

    from multigpu.launcher.rank import stop_reason

    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    if forwarded:
        stop_reason.mark_forwarded({0: str(error_file)}, signal.SIGTERM)
    done = subprocess.run([sys.executable, "-c", SAME_STOP], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert done.returncode == -signal.SIGTERM, done.stderr[-2000:]
    assert done.stderr.count("SIGTERM: the ranks stop together") == 1, done.stderr
    assert "SIGTERM again: stopping at once" in done.stderr
    assert done.stdout.split() == (["SIGTERM"] if forwarded else [])


@pytest.mark.parametrize("written", [True, False])
def test_the_agent_s_sigterm_after_a_failure_is_said_as_that_failure(tmp_path, monkeypatch, capsys,
                                                                      written):
    """Where the launcher wrote why it stops the ranks (stop_reason, beside this attempt's error
    files), a SIGTERM says that; else it is a stop asked for, said as before."""
    attempt = tmp_path / "run_x" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / "0" / "error.json"))
    if written:
        from multigpu.launcher.rank import stop_reason

        stop_reason.write({0: str(attempt / "0" / "error.json"), 1: str(attempt / "1" / "error.json")},
                          {1: -signal.SIGKILL})
    control = Control(DistEnv(), Cadence())
    with control.signal_handlers():
        os.kill(os.getpid(), signal.SIGTERM)
        assert control.stop_requested == "SIGTERM"
    said = capsys.readouterr().err
    if written:
        assert said == ("multigpu: warning: stopping: local rank 1 was killed by SIGKILL, and the "
                        "launcher stops every rank; the last complete checkpoint is kept\n")
    else:
        assert said.startswith("multigpu: warning: SIGTERM: the ranks stop together")


def test_an_ignored_signal_stays_ignored():
    before = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # as under nohup
    try:
        with Control(DistEnv(), Cadence()).signal_handlers():
            assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before)


class TwoRanks(DistEnv):
    """Rank 0 of two, whose peer contributes nothing: the exchanges are recorded."""

    def __init__(self):
        super().__init__(world_size=2)
        object.__setattr__(self, "exchanges", [])

    def all_max(self, values):
        self.exchanges.append(values)
        return list(values)


def test_exchanges_come_about_every_second_also_right_after_a_resume():
    clock, env = Clock(), TwoRanks()
    control = Control(env, Cadence(), clock=clock)
    control.saved(1000)  # resumed at step 1000
    steps_exchanged = []
    for step in range(1001, 1400):
        clock.now += 0.01  # 10 ms a step
        before = len(env.exchanges)
        control.after_step(step)
        if len(env.exchanges) > before:
            steps_exchanged.append(step)
    assert steps_exchanged[:2] == [1001, 1002], "at once after the resume, not 1000 steps later"
    gaps = [b - a for a, b in zip(steps_exchanged[1:], steps_exchanged[2:])]
    assert gaps and all(99 <= g <= 100 for g in gaps), f"then about every second: {gaps}"
