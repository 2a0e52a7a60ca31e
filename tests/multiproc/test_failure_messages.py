"""What the console shows when ranks fail, through the real launcher (2 CPU processes, gloo): a
rank's own error is said once, however the agent stopped the other ranks, and the rank that
failed first comes first, without the lost-peer traceback of the rank that only echoed it."""
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import multigpu
from .test_guards_cli import DIVERGES

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_a_nan_loss_is_said_once(tmp_path):
    done = multigpu("train", *DIVERGES, "--devices", "cpu:2", "--out", tmp_path / "run")
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert said.count("multigpu: error: the loss became nan at step ") == 1, said[-3000:]
    assert said.count("error:") == 1 and "failed first" not in said


def test_an_unused_parameter_is_said_once(tmp_path):
    done = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "logs",
                    HERE / "lib_scripts" / "unused_parameter.py")
    assert done.returncode == 2, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert said.count("multigpu: error: 2 parameter(s) got no gradient in the first backward: "
                      "initial.weight, initial.bias.") == 1, said[-3000:]
    assert said.count("error:") == 1 and "Traceback" not in said


@pytest.mark.smoke
def test_a_script_s_traceback_is_the_one_python_prints(tmp_path):
    """Without multigpu's and runpy's frames above the script's; all of them with --debug."""
    script = HERE / "scripts" / "raises_in_a_function.py"
    alone = subprocess.run([sys.executable, script], capture_output=True, text=True)
    done = multigpu("run", "--devices", "cpu:1", "--log-dir", tmp_path / "logs", script)
    assert done.returncode == alone.returncode == 1
    shown = done.stderr.splitlines()
    assert shown[1:1 + len(alone.stderr.splitlines())] == alone.stderr.splitlines(), done.stderr
    debug = multigpu("--debug", "run", "--devices", "cpu:1", "--log-dir", tmp_path / "logs", script)
    assert "runpy" in debug.stderr and alone.stderr.splitlines()[-1] in debug.stderr


@pytest.mark.smoke
def test_a_script_python_cannot_parse_is_refused_before_any_process_starts(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("x = (\n")
    done = multigpu("run", "--devices", "cpu:1", "--log-dir", tmp_path / "logs", script)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"multigpu: error: {script}:1: Python cannot parse it ('(' was never closed): fix this "
        "line (a Python 2 script needs porting); no process was started"]
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("source", [
    "import asyncio\n\n\nasync def main():\n    raise asyncio.CancelledError()\n\nasyncio.run(main())\n",
    "def f():\n    yield from undefined_name\n\nlist(f())\n"], ids=["a BaseException", "a NameError"])
def test_a_script_s_own_error_of_any_kind_is_printed_as_python_prints_it(tmp_path, source):
    """asyncio's CancelledError is a BaseException, not an Exception; a NameError inside a
    generator: each as Python prints it, without a frame of multigpu's."""
    script = tmp_path / "script.py"
    script.write_text(source)
    alone = subprocess.run([sys.executable, script], capture_output=True, text=True)
    done = multigpu("run", "--devices", "cpu:1", "--log-dir", tmp_path / "logs", script)
    assert done.returncode == alone.returncode == 1
    expected, shown = alone.stderr.splitlines(), done.stderr.splitlines()
    start = shown.index(expected[0]) if expected[0] in shown else -1
    assert start >= 0 and shown[start:start + len(expected)] == expected, done.stderr
    assert "runpy" not in done.stderr and "worker.py" not in done.stderr


def test_the_rank_that_failed_first_comes_first_without_the_lost_peer_noise(tmp_path):
    done = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "logs",
                    HERE / "scripts" / "fail_rank1_in_collective.py")
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[0].startswith("multigpu: 2 CPU processes (gloo)")
    # "(exit code 1, local rank 1", or where the agent stopped rank 1 as it exited (a loaded
    # machine), "(exit code 1, then the agent's SIGTERM as it exited": the next test causes that
    assert lines[1].startswith("multigpu: rank 1 failed first (exit code 1, "), done.stderr
    assert done.stderr.count("ValueError: boom-rank-1") == 1
    assert done.stderr.count("Traceback") == 1  # rank 1's; rank 0's echo is in its error file
    assert 'File "' in done.stderr and "runpy" not in done.stderr and "worker.py" not in done.stderr
    assert "Connection closed" not in done.stderr and "gloo" not in done.stderr.replace(
        "(gloo)", "")
    assert lines[-2].startswith("multigpu: also stopped: rank 0 (")
    assert lines[-1] == f"multigpu: logs of every rank: {tmp_path / 'logs'}"


@pytest.mark.extended  # make test stays under 15 minutes; CI runs it
def test_a_rank_stopped_while_it_exits_on_its_own_error_still_failed_first(tmp_path):
    """Rank 1 raises, then is slow to exit; rank 0 times out in its all_reduce and ends first, so
    the agent's SIGTERM ends rank 1: its own error is named, with the exit code of an error."""
    done = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "logs",
                    HERE / "scripts" / "fail_rank1_then_linger.py")
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    assert lines[1].startswith("multigpu: rank 1 failed first (exit code 1, then the agent's "
                               "SIGTERM as it exited, local rank 1, pid "), done.stderr
    assert lines[2:5] == ["multigpu: ---- rank 1 traceback ----", "Traceback (most recent call last):",
                          f'  File "{HERE / "scripts" / "fail_rank1_then_linger.py"}", line 16, in <module>'
                          ], done.stderr
    assert done.stderr.count("Traceback") == 1 and lines[-2] == "multigpu: also stopped: rank 0 (exit 1)"


def test_two_ranks_failing_the_same_way_show_one_traceback(tmp_path):
    """Both ranks of a user's DDP script with an unused module fail on their own: rank 0's
    traceback is on the console, and the report names the first rank without repeating it."""
    done = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "logs",
                    HERE / "scripts" / "ddp_unused_module.py")
    assert done.returncode == 1, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert said.count("Traceback (most recent call last)") == 1, said[-4000:]
    report = [line for line in done.stderr.splitlines() if line.startswith("multigpu: ")]
    assert report[1].startswith("multigpu: rank ") and " failed first (exit code 1" in report[1], report
    assert report[2] in ("multigpu: its traceback is in its output above",) or report[2].startswith(
        "multigpu: its error is the one rank 0 printed above: RuntimeError: Expected to have "
        "finished reduction"), report
