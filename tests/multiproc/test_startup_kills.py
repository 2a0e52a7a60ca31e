"""A launch killed or stopped while it starts: its workers end within seconds, and the same
command (or the same with --resume) runs the run in the same folder, keeping the earlier logs.

The moments are markers (a line the launcher or rank 0 prints, the workers' pids appearing),
never bare sleeps; each kill is a real kill -9 or SIGINT of the launcher.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from .conftest import cli_env, read_metrics, track

pytestmark = pytest.mark.slow

COMMAND = ["train", "--model", "cnn", "--data", "digits", "--batch-size", "4", "--epochs", "1",
           "--workers", "0"]


class Launch:
    """`multigpu train COMMAND --out OUT` started, its output read line by line as it comes."""

    def __init__(self, out: Path, *extra: str, devices="cpu:2", env=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "multigpu", *COMMAND, "--devices", devices,
                                      "--out", str(out), *extra], env=env or cli_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        track(self.proc)
        self.lines: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                         for s in (self.proc.stdout, self.proc.stderr)]
        for t in self._readers:
            t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, what, timeout=120.0):
        """The first truthy what() (a line seen, workers started), polled until `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = what()
            if found:
                return found
            assert self.proc.poll() is None, "\n".join(self.lines[-30:])
            time.sleep(0.01)
        raise AssertionError(f"not seen in {timeout} s:\n" + "\n".join(self.lines[-30:]))

    def line(self, start: str, containing: str = ""):
        return lambda: next((s for s in self.lines if s.startswith(start) and containing in s), None)

    def workers(self, count=2):
        def found():
            kids = []
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:  # a child forked but not yet exec'd still shows the launcher's environment
                    if "LOCAL_RANK" in p.environ():
                        kids.append(p)
                except psutil.Error:
                    pass
            return kids if len(kids) >= count else None
        return found

    def finish(self, timeout=240) -> str:
        self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=10)
        return "\n".join(self.lines)


def workers_of_folder(out: Path) -> list[psutil.Process]:
    """Every live process started as a worker for `out`, wherever it is in the process tree."""
    found = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if env.get("MULTIGPU_OUT_RESERVED") == str(out.resolve()) and "LOCAL_RANK" in env \
                    and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def kill_9(launch: Launch) -> None:
    launch.proc.kill()
    launch.proc.wait()


def assert_workers_end(out: Path, known: list[psutil.Process], within=10.0) -> None:
    _, alive = psutil.wait_procs(known, timeout=within)
    assert not alive, f"workers {[p.pid for p in alive]} went on without their launcher"
    deadline = time.monotonic() + within
    while (left := workers_of_folder(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"workers {[p.pid for p in left]} went on without their launcher"


def assert_same_command_trains(out: Path, *extra: str, **launch) -> str:
    earlier = {p.name for p in (out / "logs").iterdir()} if (out / "logs").is_dir() else set()
    again = Launch(out, *extra, **launch)
    said = again.finish()
    assert again.proc.returncode == 0, said[-3000:]
    assert [m["epoch"] for m in read_metrics(out)] == [1]
    assert json.loads((out / "config.json").read_text())["model"] == "cnn"
    assert earlier <= {p.name for p in (out / "logs").iterdir()}, "the earlier launch's logs are kept"
    return said


MOMENTS = {
    # the launcher's header: torch's agent not started yet
    "header": lambda run: run.wait_for(run.line("multigpu: ", "rank 0 shown here")),
    # both workers exist: in their first lines, or importing
    "workers started": lambda run: run.wait_for(run.workers()),
    # rank 0's first line (after the process group, the data and the model): before the first step
    "before the first step": lambda run: run.wait_for(run.line("multigpu train: cnn on digits")),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_kill_9_of_the_launcher_during_start_up_ends_its_workers_and_the_same_command_runs(tmp_path, moment):
    out = tmp_path / "run"
    run = Launch(out)
    MOMENTS[moment](run)
    workers = run.workers(count=0)() or []
    kill_9(run)
    assert_workers_end(out, workers)
    assert json.loads((out / "config.json").read_text()) is not None  # left behind: taken again
    if list(out.glob("checkpoints/step-*.pt")):
        # Rank 0's line came and went before the kill landed, and the first step with it: from
        # then on an orphan saves and stops (a loaded machine can be that slow to read a line).
        # The folder is the run's now: the plain command names --resume, which goes on.
        refused = Launch(out)
        said = refused.finish()
        assert refused.proc.returncode == 2 and "(to continue that run, add --resume)" in said, said
        assert_same_command_trains(out, "--resume", str(out))
        return
    if moment != "workers started":
        assert "already exists" not in assert_same_command_trains(out)
        return
    # the same with --resume, which found "no checkpoint there": a new start, said in one line
    said = assert_same_command_trains(out, "--resume", str(out))
    assert said.count(f"multigpu train: --resume {out}: nothing was trained there yet (no "
                      "checkpoint); starting from scratch in it") == 1, said[-3000:]


def test_kill_9_while_the_workers_set_up_their_process_group(tmp_path):
    """Between the workers' start and rank 0's first line: importing torch, meeting at the store
    the launcher hosts. The workers are found first, the kill comes a second later."""
    out = tmp_path / "run"
    run = Launch(out)
    workers = run.wait_for(run.workers())
    time.sleep(1.0)
    assert not run.line("multigpu train: cnn on digits")(), "rank 0 was ready already"
    kill_9(run)
    assert_workers_end(out, workers)
    assert_same_command_trains(out)


def test_sigint_during_start_up_leaves_no_folder_and_the_same_command_runs(tmp_path):
    out = tmp_path / "run"
    run = Launch(out)
    workers = run.wait_for(run.workers())
    run.proc.send_signal(signal.SIGINT)
    said = run.finish(timeout=60)
    assert run.proc.returncode == 128 + signal.SIGINT, said[-3000:]
    assert_workers_end(out, workers)
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    assert_same_command_trains(out)


def test_the_same_command_waits_for_the_stopping_workers_of_a_killed_launcher(tmp_path):
    """Training has begun: the orphaned workers save and stop (which takes a while). Held still
    (SIGSTOP) until the next command says it waits for them, they are then let go."""
    out = tmp_path / "run"
    run = Launch(out, "--epochs", "3", "--checkpoint-every", "10")
    workers = run.wait_for(run.workers())
    run.wait_for(lambda: list(out.glob("checkpoints/*.pt")))
    for w in workers:
        w.suspend()
    kill_9(run)
    again = Launch(out, "--epochs", "3", "--checkpoint-every", "10", "--resume", str(out))
    pids = ", ".join(str(w.pid) for w in sorted(workers, key=lambda w: w.pid))
    again.wait_for(again.line(f"multigpu train: --out {out} is still held by the stopping workers "
                              f"of an earlier launch whose launcher is gone (pid {pids}); waiting "
                              "up to 35 s for them"))
    for w in workers:
        w.resume()
    said = again.finish()
    assert again.proc.returncode == 0, said[-3000:]
    assert_workers_end(out, workers)
    assert [m["epoch"] for m in read_metrics(out)] == [1, 2, 3]


# Holds the command inside its first imports (the parser's modules): a Ctrl-C lands there.
_SLOW_IMPORT = '''
import sys, time

class _Slow:
    def find_spec(self, name, path=None, target=None):
        if name == "multigpu.launcher.watchdog":
            print("importing multigpu.watchdog", file=sys.stderr, flush=True)
            time.sleep(60)
        return None

sys.meta_path.insert(0, _Slow())
'''


def test_ctrl_c_while_the_command_imports_is_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SLOW_IMPORT)
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    run = Launch(tmp_path / "run", env=env)
    run.wait_for(run.line("importing multigpu.watchdog"))
    run.proc.send_signal(signal.SIGINT)
    said = run.finish(timeout=60)
    assert run.proc.returncode == 130, said
    assert said.splitlines() == ["importing multigpu.watchdog", "multigpu: interrupted"], said
    assert not (tmp_path / "run").exists()
