"""The watchdog's decision and its words (pure functions), and the changed-variable check."""
import json
import os
import subprocess
import sys
import threading
import time

from multigpu.launcher.rank import watchdog
from multigpu.launcher.rank.watchdog import hung, summarize, where

NOW = 1000.0


def status(stalled, where_="train.py:3 in loop", state="running", t=NOW, changed=None):
    return {"t": t, "stalled": stalled, "where": where_, "state": state, "changed": changed or {}}


def test_every_rank_stalled_is_a_hang():
    assert hung({0: status(31), 1: status(40)}, NOW, timeout=30, silent_after=8)


def test_a_rank_still_moving_means_the_others_wait_for_it_not_a_hang():
    assert not hung({0: status(300), 1: status(2)}, NOW, timeout=30, silent_after=8)


def test_finished_and_silent_ranks_leave_the_waiting_ones_hung():
    statuses = {0: status(31), 1: status(0, state="finished"), 2: status(5, t=NOW - 60), 3: None}
    assert hung(statuses, NOW, timeout=30, silent_after=8)
    assert not hung({0: status(0, state="finished"), 1: None}, NOW, 30, 8), "nobody is waiting"


def test_the_summary_names_each_rank_where_it_is_and_what_its_script_changed():
    text = summarize({0: status(31, "in all_reduce (torch) called from train.py:10 in step"),
                      1: status(33, "train.py:20 in evaluate", changed={"MASTER_PORT": ["41234", "29500"]}),
                      2: None, 3: status(0, state="finished")}, NOW, 30, 8)
    assert text.splitlines() == [
        "hang: no rank made progress for 30 s (--hang-timeout 30); each rank's stack is in "
        "hang-rank<N>.txt beside the logs",
        "rank 0: stuck 31 s in all_reduce (torch) called from train.py:10 in step",
        "rank 1: stuck 33 s train.py:20 in evaluate",
        "rank 1: its script set MASTER_PORT=29500; multigpu had set 41234: leave MASTER_PORT to "
        "the launcher",
        "rank 2: gone (its process ended or stopped answering)",
        "rank 3: finished its script while the others waited for it",
    ]


def test_where_names_the_innermost_torch_call_and_the_users_line():
    torch_file = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")
    stack = (("train.py", 30, "<module>"), ("train.py", 10, "step"), (torch_file, 2800, "all_reduce"))
    assert where(stack) == "in all_reduce (torch) called from train.py:10 in step"
    assert where((("train.py", 30, "<module>"), ("train.py", 12, "wait"))) == "train.py:12 in wait"


def test_the_main_threads_stack_is_read_from_another_thread():
    seen = {}
    main = threading.main_thread().ident

    def look():
        seen["stack"] = watchdog.main_stack(main)
    t = threading.Thread(target=look)
    t.start()
    t.join()
    assert any(f[2] == "test_the_main_threads_stack_is_read_from_another_thread" for f in seen["stack"])


def test_a_variable_the_script_changes_is_named_once_with_multigpus_value(monkeypatch, capsys):
    monkeypatch.setenv("MASTER_PORT", "41234")
    dog = watchdog.Watchdog(timeout=0)
    os.environ["MASTER_PORT"] = "29500"  # what post 002's script does
    dog._check_env()
    dog._check_env()
    err = capsys.readouterr().err
    assert err.count("the script set") == 1, "named once"
    assert "the script set MASTER_PORT=29500 (multigpu had set 41234)" in err
    assert dog.changed == {"MASTER_PORT": ("41234", "29500")}


def test_the_error_file_holds_the_summary_for_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    watchdog.write_error_file("hang: no rank made progress")
    data = json.loads((tmp_path / "error.json").read_text())
    assert data["message"] == "hang: no rank made progress" and data["timestamp"] <= time.time()


EXITS_WHILE_THE_WATCHDOG_TALKS = """
import datetime, os, sys, time
import torch.distributed as dist
from multigpu.launcher.rank import watchdog

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
os.environ.update(TORCHELASTIC_RUN_ID="t", MULTIGPU_HANG_TIMEOUT="0.5", WORLD_SIZE="2", RANK="0",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
# the thread spends all its time inside TCPStore calls, as it does for an instant every interval
watchdog.Watchdog._check_hang = lambda self: [self._connect().check(["k"]) for _ in range(3000)]
watchdog.start_from_env()
time.sleep(0.5)
print("script done", flush=True)
"""


def test_a_script_ending_while_the_watchdog_is_inside_a_store_call_exits_cleanly(tmp_path):
    """A daemon thread still inside a C++ call when Python finalizes is ended by pthread_exit,
    which aborts the process (SIGABRT, "terminate called without an active exception"): a
    finished rank reported as failed. The watchdog's thread is joined at exit instead."""
    (tmp_path / "script.py").write_text(EXITS_WHILE_THE_WATCHDOG_TALKS)
    for _ in range(3):
        proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], capture_output=True,
                              text=True, timeout=60)
        assert (proc.returncode, proc.stdout) == (0, "script done\n"), proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
