"""A Ctrl-C at any moment of a launch's start-up stops it: exit 130, one line, no traceback, no
run folder left, at once (issue 40, item 3). The moments are the ones a storm of Ctrl-Cs at
random moments on the loaded 2-core VM found (benchmarks/ctrl_c_storm.py), each held still by the
workers' sitecustomize (test_startup_kills.held_at) so that the signal lands there every time.
"""
import os
import signal

import pytest

from .conftest import cli_env
from .test_startup_kills import Launch, assert_workers_end, held_at

pytestmark = pytest.mark.slow

# A longer wait than the ranks need to end on a signal (they need well under a second) but not
# torch's 30 s: a rank that did not stop is killed, and said so, sooner.
SHUTDOWN_WAIT = "15"


def _first_lines(tmp_path, out):
    """Rank 0 held in the first lines of `python -m multigpu`, where it looks up the run folder's
    module (before the CLI's own handling of a KeyboardInterrupt); rank 1 goes on into its process
    group's set-up, where it waits in torch's C++ for rank 0 at the store."""
    env, markers = held_at(tmp_path, rank0=("multigpu.train.folder_users", 120, False))
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = SHUTDOWN_WAIT
    run = Launch(out, env=env)
    run.wait_for(lambda: (markers / "rank0-multigpu.train.folder_users").exists())
    return run, run.wait_for(run.workers())


# Put first on the workers' PYTHONPATH: at its first lookup of HOLD_MODULE, each rank drops an
# object whose finalizer leaves a marker and waits there. Python prints a KeyboardInterrupt raised
# inside a finalizer ("Exception ignored in ...") and goes on: a Ctrl-C that lands in one (torch's
# and the imports' are brief, but many) was lost, the ranks trained on to exit 0.
_IN_A_FINALIZER = """
import os, sys, time

class _Held:
    def __del__(self):
        open(os.path.join(os.environ["HOLD_MARKERS"], "rank" + os.environ["RANK"]), "w").close()
        time.sleep(120)

class _Finder:
    done = False

    def find_spec(self, name, path=None, target=None):
        if name == os.environ["HOLD_MODULE"] and not self.done:
            self.done = True
            _Held()
        return None

if "LOCAL_RANK" in os.environ:
    sys.meta_path.insert(0, _Finder())
"""


def _a_finalizer(tmp_path, out):
    """Both ranks inside a finalizer, before their process group."""
    (tmp_path / "hold").mkdir()
    (tmp_path / "hold" / "sitecustomize.py").write_text(_IN_A_FINALIZER)
    markers = tmp_path / "markers"
    markers.mkdir()
    env = cli_env()
    env.update(PYTHONPATH=f"{tmp_path / 'hold'}{os.pathsep}{env['PYTHONPATH']}",
               HOLD_MODULE="multigpu.core.distributed", HOLD_MARKERS=str(markers),
               TORCH_ELASTIC_SHUTDOWN_TIMEOUT=SHUTDOWN_WAIT)
    run = Launch(out, env=env)
    run.wait_for(lambda: all((markers / f"rank{r}").exists() for r in (0, 1)))
    return run, run.wait_for(run.workers())


@pytest.mark.parametrize("moment", [_first_lines, _a_finalizer],
                         ids=["a rank's first lines", "a finalizer"])
def test_ctrl_c_while_the_ranks_start_is_one_line_and_stops_them_at_once(tmp_path, moment):
    out = tmp_path / "run"
    run, workers = moment(tmp_path, out)
    run.proc.send_signal(signal.SIGINT)
    said = run.finish(timeout=120)
    assert run.proc.returncode == 128 + signal.SIGINT, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    # rank 0's line alone: not the launcher's "stopped by SIGINT; ... (killed: they had not
    # stopped 15 s after the signal)" of a rank that went on waiting
    assert said.count("multigpu: interrupted") == 1, said[-3000:]
    assert "stopped by SIGINT" not in said, said[-3000:]
    assert said.count(f"multigpu train: nothing was trained: {out} removed") == 1, said[-3000:]
    assert not out.exists()
    assert_workers_end(out, workers)
