"""Library scripts through `multigpu run` on CPU/gloo: the traps the library catches."""
import json
from pathlib import Path

import pytest

from .conftest import multigpu

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "lib_scripts"


def test_unused_parameter_is_named_with_the_fix_at_the_first_step(tmp_path):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path, SCRIPTS / "unused_parameter.py")
    assert proc.returncode == 2, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert ("multigpu: error: 2 parameter(s) got no gradient in the first backward: "
            "initial.weight, initial.bias") in output
    assert "find_unused_parameters=True" in output
    assert "Expected to have finished reduction" not in output  # DDP's cryptic error never comes
    assert "Traceback" not in output  # multigpu's own message: one line
    debug = multigpu("--debug", "run", "--devices", "cpu:2", "--log-dir", tmp_path / "debug",
                     SCRIPTS / "unused_parameter.py")
    # --debug lets the error raise: Python's exit 1 for an uncaught exception, with its traceback
    assert debug.returncode == 1 and "Traceback" in debug.stdout + debug.stderr


@pytest.mark.parametrize("flag", ["--find-unused", pytest.param("--teacher", marks=pytest.mark.extended)])
def test_unused_parameter_check_lets_correct_runs_finish(tmp_path, flag):
    # --find-unused: DDP searches itself. --teacher: a second prepared model that takes no part
    # in the loss (a teacher or EMA model run under no_grad) is not an unused parameter.
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path,
                    SCRIPTS / "unused_parameter.py", flag)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished" in proc.stdout


@pytest.mark.parametrize("procs", [1, 3])
def test_metrics_count_every_sample_once(tmp_path, procs):
    out = tmp_path / "metrics.json"
    proc = multigpu("run", "--devices", f"cpu:{procs}", "--log-dir", tmp_path / "logs",
                    SCRIPTS / "exact_metrics.py", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == {"accuracy": pytest.approx(5 / 7), "mean": pytest.approx(3.0), "seen": 7.0,
                      "world_size": procs}


def _run_accumulate(tmp_path, accumulate, batch_size):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / f"logs{accumulate}",
                    SCRIPTS / "accumulate.py", accumulate, batch_size)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.smoke
def test_accumulation_all_reduces_once_per_window_and_matches_the_big_batch(tmp_path):
    # 44 samples, 2 ranks. Batch 4 per rank: optimizer steps of 8, 8, 8, 8, 8, 4 samples.
    # Batch 2 with accumulate 2: 11 micro-steps of 4, grouped into the same 6 windows.
    big = _run_accumulate(tmp_path, 1, 4)
    acc = _run_accumulate(tmp_path, 2, 2)
    assert big["optimizer_steps"] == acc["optimizer_steps"]
    # One bucket per step (a tiny model): all-reduce only on the last micro-batch of each window.
    assert acc["allreduce_calls"] == acc["optimizer_steps"] == big["allreduce_calls"]
    for a, b in zip(big["weights"], acc["weights"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_buffers_not_broadcast_every_step_start_equal_and_sync_from_rank0(tmp_path):
    proc = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path, SCRIPTS / "buffers.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "after_prepare": True, "after_training": False, "after_sync": True}


@pytest.mark.parametrize("procs", [pytest.param(1, marks=pytest.mark.extended), 3])
def test_a_users_loop_resumes_inside_an_epoch_on_another_process_count(tmp_path, procs):
    script = SCRIPTS / "resume_loader.py"
    stop = multigpu("run", "--devices", "cpu:2", "--log-dir", tmp_path / "a", script, tmp_path, "stop")
    assert stop.returncode == 0, stop.stderr[-3000:]
    resume = multigpu("run", "--devices", f"cpu:{procs}", "--log-dir", tmp_path / "b", script,
                      tmp_path, "resume")
    assert resume.returncode == 0, resume.stderr[-3000:]
    seen = [i for f in sorted(tmp_path.glob("*-rank*.json")) for i in json.loads(f.read_text())]
    assert sorted(seen) == list(range(50)), "every sample of the epoch once"


@pytest.mark.parametrize("asked", [False, True])
def test_setup_changes_nothing_of_the_process_unless_asked(tmp_path, asked):
    # a library call: sys.excepthook, the atexit handlers and the environment are left as they
    # were (multigpu run's worker tears the group down itself); install_hooks=True installs both
    args = ["--install-hooks"] if asked else []
    proc = multigpu("run", "--devices", "cpu:2", SCRIPTS / "process_state.py", tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    states = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for state in states:
        assert (state["excepthook_by"] == "multigpu.core.distributed") is asked, state
        assert state["atexit_added"] == (1 if asked else 0) and state["env_changed"] == [], state
    assert "Traceback" not in proc.stderr
