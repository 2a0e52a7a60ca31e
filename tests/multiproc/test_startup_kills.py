"""A launch killed or stopped while it starts: its workers end within seconds, and the same
command (or the same with --resume) runs the run in the same folder, keeping the earlier logs.

The moments are markers (a line the launcher or rank 0 prints, the workers' pids appearing, a
worker held at an import by a sitecustomize of the test's, see `held_at`), never bare sleeps;
each kill is a real kill -9 or SIGINT of the launcher.
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

from .conftest import cli_env, read_metrics, suspend, track

pytestmark = pytest.mark.slow

COMMAND = ["train", "--model", "cnn", "--data", "digits", "--batch-size", "4", "--epochs", "1",
           "--workers", "0"]


def sigint_default() -> None:
    """SIGINT as a terminal's command has it: a shell that ran the tests in the background set it
    ignored for its children, and a launcher that ignored it was not stopped by the tests' Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Launch:
    """`multigpu train COMMAND --out OUT` started, its output read line by line as it comes."""

    def __init__(self, out: Path, *extra: str, devices="cpu:2", env=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "multigpu", *COMMAND, "--devices", devices,
                                      "--out", str(out), *extra], env=env or cli_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=sigint_default)
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


# Put first on a launch's PYTHONPATH: a worker whose rank HOLD_AT names, at the first lookup of
# its module (after its process group exists, when "grouped"), leaves a marker file in
# HOLD_MARKERS and then waits there "seconds" (the kernel's death signal still ends it: orphans.py).
_HOLD = """
import json, os, sys, time

_AT = json.loads(os.environ.get("HOLD_AT", "{}")) if "LOCAL_RANK" in os.environ else {}
_DONE = set()

class _Hold:
    def find_spec(self, name, path=None, target=None):
        at = _AT.get(os.environ.get("RANK"))
        if at and name == at["module"] and name not in _DONE:
            dist = sys.modules.get("torch.distributed")
            if at["grouped"] and not (dist and dist.is_available() and dist.is_initialized()):
                return None
            _DONE.add(name)
            marker = os.path.join(os.environ["HOLD_MARKERS"], f"rank{os.environ['RANK']}-{name}")
            open(marker, "w").close()
            time.sleep(at["seconds"])
        return None

sys.meta_path.insert(0, _Hold())
"""


def held_at(tmp_path: Path, base: dict | None = None, **ranks) -> tuple[dict, Path]:
    """The environment (`base`, else cli_env()) of a launch whose workers are held as `ranks`
    says (rank0=(module, seconds, grouped), ...), and the folder of their markers."""
    (tmp_path / "hold").mkdir(exist_ok=True)
    (tmp_path / "hold" / "sitecustomize.py").write_text(_HOLD)
    markers = tmp_path / "markers"
    markers.mkdir(exist_ok=True)
    env = dict(base) if base is not None else cli_env()
    env["PYTHONPATH"] = f"{tmp_path / 'hold'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["HOLD_AT"] = json.dumps({r.removeprefix("rank"): {"module": m, "seconds": s, "grouped": g}
                                 for r, (m, s, g) in ranks.items()})
    env["HOLD_MARKERS"] = str(markers)
    return env, markers


# The moment of a kill: (how the workers are held, or None; what to wait for).
MOMENTS = {
    # the launcher's header: torch's agent not started yet
    "header": (None, lambda run, _: run.wait_for(run.line("multigpu: ", "rank 0 shown here"))),
    # both workers exist: in their first lines, or importing
    "workers started": (None, lambda run, _: run.wait_for(run.workers())),
    # after rank 0's first line (the process group, the data and the model are there): rank 0
    # held where it looks up its loggers' module (RunLog.open), before its first step; rank 1
    # cannot step alone (its first backward waits for rank 0's gradients)
    "before the first step": (
        {"rank0": ("tensorboard", 120, True)},
        lambda run, markers: (run.wait_for(lambda: (markers / "rank0-tensorboard").exists()),
                              run.wait_for(run.line("multigpu train: cnn on digits")))),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_kill_9_of_the_launcher_during_start_up_ends_its_workers_and_the_same_command_runs(tmp_path, moment):
    out = tmp_path / "run"
    hold, wait = MOMENTS[moment]
    env, markers = held_at(tmp_path, **hold) if hold else (None, None)
    run = Launch(out, env=env)
    wait(run, markers)
    workers = run.workers(count=0)() or []
    kill_9(run)
    assert_workers_end(out, workers)
    assert json.loads((out / "config.json").read_text()) is not None  # left behind: taken again
    assert not list(out.glob("checkpoints/*.pt")), "killed after the first step"
    if moment != "workers started":
        assert "already exists" not in assert_same_command_trains(out)
        return
    # the same with --resume, which found "no checkpoint there": a new start, said in one line
    said = assert_same_command_trains(out, "--resume", str(out))
    assert said.count(f"multigpu train: --resume {out}: nothing was trained there yet (no "
                      "checkpoint); starting from scratch in it") == 1, said[-3000:]


def start_held_in_process_group_setup(tmp_path: Path, out: Path, devices: str = "cpu:2",
                                      base: dict | None = None):
    """A launch whose rank 1 is held before its process group, and its workers, once both ranks
    reached that point (rank 0 then waits for rank 1 at the store)."""
    env, markers = held_at(tmp_path, base, rank0=("multigpu.core.distributed", 0, False),
                           rank1=("multigpu.core.distributed", 120, False))
    run = Launch(out, devices=devices, env=env)
    run.wait_for(lambda: all((markers / f"rank{r}-multigpu.core.distributed").exists() for r in (0, 1)))
    return run, run.wait_for(run.workers())


def test_kill_9_while_the_workers_set_up_their_process_group(tmp_path):
    """Between the workers' start and rank 0's first line: rank 1 held where it imports
    multigpu.core.distributed (before its process group), rank 0 gone past it into its own set-up,
    where it waits for rank 1 at the launcher's store: no rank can be ready."""
    out = tmp_path / "run"
    run, workers = start_held_in_process_group_setup(tmp_path, out)
    kill_9(run)
    assert_workers_end(out, workers)
    assert not run.line("multigpu train: cnn on digits")(), "rank 0 was ready"
    assert_same_command_trains(out)


def _sigint_once_the_workers_started(out, times: int = 1) -> str:
    """Ctrl-C (`times` of them, 0.2 s apart) to a run into `out` once its workers run, before
    its first step: what it said (it exits 130, and its workers end)."""
    run = Launch(out)
    workers = run.wait_for(run.workers())
    for i in range(times):
        if i:
            time.sleep(0.2)
        run.proc.send_signal(signal.SIGINT)
    said = run.finish(timeout=60)
    assert run.proc.returncode == 128 + signal.SIGINT, said[-3000:]
    assert_workers_end(out, workers)
    return said


@pytest.mark.parametrize("times", [1, pytest.param(2, marks=pytest.mark.extended)],
                         ids=["ctrl-c", "double ctrl-c"])
@pytest.mark.parametrize("resume", [False, True])
def test_sigint_during_start_up_leaves_no_folder_and_the_same_command_runs(tmp_path, resume, times):
    """Or the same with --resume, as a job script that resumes its --out (a requeued SLURM job)
    runs it: refused ("no checkpoint there (no such file or folder)") once a stop during start-up
    had removed the folder. A double Ctrl-C (the workers killed at once) the same (issue 40: the
    folder it left blocked both commands)."""
    out = tmp_path / "run"
    said = _sigint_once_the_workers_started(out, times)
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    # its start said where the other ranks log: now gone with the folder, and said so
    assert said.count(f"multigpu train: nothing was trained: {out} removed") == 1, said[-3000:]
    if not resume:
        assert_same_command_trains(out)
        return
    said = assert_same_command_trains(out, "--resume", str(out))
    assert said.count(f"multigpu train: --resume {out}: nothing was trained there yet (no such "
                      "folder: a run stopped while it started leaves none); starting from "
                      "scratch in it") == 1, said[-3000:]


def test_sigint_during_start_up_keeps_an_empty_folder_the_user_made_and_says_so(tmp_path):
    """--out an empty folder made before the run: what the run wrote in it goes, the folder
    stays (it was the user's), and the line says both."""
    out = tmp_path / "mine"
    out.mkdir()
    said = _sigint_once_the_workers_started(out)
    assert out.is_dir() and not any(out.iterdir()), sorted(p.name for p in out.iterdir())
    assert said.count(f"multigpu train: nothing was trained: what the run wrote in {out} removed; "
                      f"{out} itself, made before the run, kept") == 1, said[-3000:]


@pytest.mark.extended  # about 12 s on 2 cores: CI runs it (make test-all)
def test_the_same_command_waits_for_the_stopping_workers_of_a_killed_launcher(tmp_path):
    """Training has begun: the orphaned workers save and stop (which takes a while). Held still
    (SIGSTOP) until the next command says it waits for them, they are then let go."""
    out = tmp_path / "run"
    run = Launch(out, "--epochs", "3", "--checkpoint-every", "10")
    workers = run.wait_for(run.workers())
    run.wait_for(lambda: list(out.glob("checkpoints/*.pt")))
    for w in workers:
        suspend(w)
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
        if name == "multigpu.launcher.rank.watchdog":
            print("importing multigpu.launcher.rank.watchdog", file=sys.stderr, flush=True)
            time.sleep(60)
        return None

sys.meta_path.insert(0, _Slow())
'''


@pytest.mark.smoke
def test_ctrl_c_while_the_command_imports_is_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SLOW_IMPORT)
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    run = Launch(tmp_path / "run", env=env)
    run.wait_for(run.line("importing multigpu.launcher.rank.watchdog"))
    run.proc.send_signal(signal.SIGINT)
    said = run.finish(timeout=60)
    assert run.proc.returncode == 130, said
    assert said.splitlines() == ["importing multigpu.launcher.rank.watchdog", "multigpu: interrupted"], said
    assert not (tmp_path / "run").exists()
