"""--nodes-per-run: another node ends each attempt as node 0 recorded it (slurm_task.RunTask).
Node 0's attempt can end minutes after this node's (its ranks wait out --hang-timeout, 300 s by
default, for a peer of this node that died): this node waits as long as node 0's task shows it
lives (it refreshes its record while the run goes on), and gives up only once the record stands
still for NODE0_WAIT_S (node 0's task gone)."""
import subprocess
import sys
import threading
import time

from multigpu.sweep import slurm_task
from multigpu.sweep.slurm_task import RunTask
from multigpu.sweep.state import RunState, SweepFolder


def _node(folder: SweepFolder, node: int) -> RunTask:
    task = RunTask(root=str(folder.root), cwd=str(folder.root), devices="cpu:1", retries=1, nodes=2)
    task._node, task._node0_gone, task._proc = node, False, None
    return task


def test_node_1_waits_for_a_node_0_that_lives_longer_than_the_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(slurm_task, "NODE0_WAIT_S", 1.0)
    monkeypatch.setattr(slurm_task, "HEARTBEAT_S", 0.2, raising=False)
    folder = SweepFolder(tmp_path)
    (tmp_path / "state").mkdir()
    folder.write_state(RunState("seed=1", {}, status="running", attempts=1))
    node0 = _node(folder, 0)
    node0._record = folder.state_file("seed=1")  # what _attempt sets on node 0
    node0._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.5)"])

    def node_0_s_attempt():  # its run outlives node 1's wait, then fails: node 0 retries
        node0._wait()
        folder.write_state(RunState("seed=1", {}, status="failed", attempts=1, note="exit 1"))
    threading.Thread(target=node_0_s_attempt, daemon=True).start()
    mine = RunState("seed=1", {}, status="failed", attempts=1, note="exit 3")
    node1, started = _node(folder, 1), time.monotonic()
    ended = node1._as_node0_ended(folder, mine)
    assert (ended.status, ended.note) == ("failed", "exit 1")
    assert time.monotonic() - started >= 2.0
    assert not node1._node0_gone


def test_node_1_gives_up_on_a_record_that_stands_still(tmp_path, monkeypatch):
    """Node 0's task killed -9: its record says the attempt runs, and changes no more."""
    monkeypatch.setattr(slurm_task, "NODE0_WAIT_S", 1.0)
    folder = SweepFolder(tmp_path)
    (tmp_path / "state").mkdir()
    folder.write_state(RunState("seed=1", {}, status="running", attempts=1))
    node1 = _node(folder, 1)
    started = time.monotonic()
    ended = node1._as_node0_ended(folder, RunState("seed=1", {}, status="failed", attempts=1))
    assert ended.status == "failed" and node1._node0_gone
    assert 1.0 <= time.monotonic() - started < 3.0
