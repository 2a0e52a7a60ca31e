"""One run of a sweep inside a SLURM job: what each task of the sweep's job array executes.

submitit unpickles a RunTask in the job and calls it with the run's name. It runs the run's
command as the local sweep does (scheduler.py: the same command line, run folder, log and state
file), and starts a failed run again up to --retries times, from its checkpoint.

Before the job's time limit SLURM sends SIGUSR1 to this process alone (sbatch
--signal=B:USR1@90, and the batch shell execs this Python): the run gets it once, saves a
checkpoint and stops; then submitit's requeue protocol runs (its handler calls checkpoint() below,
saves what it returns and calls `scontrol requeue`), and the task's next start resumes the run
from that checkpoint. The signal is passed on exactly once because a second one stops
`multigpu train` at once, without a checkpoint.

A run of several nodes (--nodes-per-run): srun starts this task once per node, and each runs the
run's command, which joins the others through the launcher's SLURM support, at a port derived
from the job's id (the same on every node without a word between them). Node 0 alone owns the
sweep folder: it prepares the run folder, writes the state, the log, the events and the summary,
and requeues the job. The others log into DIR/logs/NAME.nodeK.log. Before the time limit SLURM
sends SIGUSR2 to every process of the step (slurm.py says why not SIGUSR1); the run's processes
ignore it (set here before the exec, inherited by the launcher, its ranks and their loader
workers), and each node's task passes one SIGUSR1 to its own part of the run. A failure on any
node fails the collective on the others, so each node's attempt ends failed, each starts the
same retries, and node 0 records the failure once.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from multigpu.core.checkpoints.checkpoint_schema import checkpoints_folder
from multigpu.core.errors import UsageError
from multigpu.launcher import ports
from multigpu.launcher.ports import DEFAULT_PORT
from multigpu.sweep import spec as specs
from multigpu.sweep.attempts import classify, prepare_folder
from multigpu.sweep.scheduler import Options, Sweep
from multigpu.sweep.starter import child_setup
from multigpu.sweep.state import RunState, SweepFolder

REQUEUED = "requeued by SLURM before its time limit (SIGUSR1); it resumes from its checkpoint"
NODE0_WAIT_S = 120.0  # how long another node waits on a record of node 0's that stands still
HEARTBEAT_S = 20.0  # node 0 refreshes its record this often while its part of the run lives


class RunFailed(RuntimeError):
    """A run that failed every attempt: the SLURM task ends FAILED with its reason."""


@dataclass
class RunTask:
    root: str
    cwd: str  # the submitting command's directory: the command's relative paths start there
    devices: str  # each run's --devices: "2" (GPUs SLURM gave the job) or "cpu:2"
    retries: int = 0
    timeout_s: float | None = None
    grace_s: float = 60.0
    nodes: int = 1  # --nodes-per-run: srun starts this task on each of them

    def __call__(self, name: str) -> str:
        if Path(self.cwd).is_dir():
            os.chdir(self.cwd)
        sweep = self._sweep()
        run = next((r for r in sweep.runs if r.name == name), None)
        if run is None:
            raise UsageError(f"run {name} is not in the sweep of {self.root} any more")
        self._proc, self._signalled, self._node = None, False, node_rank(self.nodes)
        self._node0_gone, self._record, self._last_attempt = False, None, 0
        warned = signal.SIGUSR2 if self.nodes > 1 else signal.SIGUSR1  # slurm.SlurmSettings
        requeue = signal.signal(warned, self._on_signal)  # submitit's: called once stopped
        for tries in range(1, self.retries + 2):
            if self._signalled:  # between two attempts
                break
            st = self._attempt(sweep, run)
            if self._node > 0:  # node 0 decides; a node that retried alone would wait for it
                st = self._as_node0_ended(sweep.folder, st)
            retry = (st.status == "failed" and tries <= self.retries and not self._signalled
                     and not self._node0_gone)
            if retry:
                st.note += f"; retrying ({tries}/{self.retries})"
            if self._node == 0:
                sweep.folder.write_state(st)
                sweep.report(st)
                sweep.write_summary()
            if not retry:
                break
        if self._signalled and st.status != "done" and callable(requeue):
            requeue(warned, None)  # checkpoint() then scontrol requeue; exits (node 0)
        if st.status == "failed":
            raise RunFailed(f"{name}: {st.note}")
        return st.status

    def __getstate__(self) -> dict:
        """Pickled without the run's process and the signal seen (checkpoint() pickles self)."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def checkpoint(self, name: str):
        """submitit's requeue protocol: the same call again, after the requeue."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, name)

    def _as_node0_ended(self, folder: SweepFolder, mine: RunState) -> RunState:
        """This node's attempt `mine`, ended as node 0 recorded the same attempt: its status
        decides the retry and the task's end on every node. The nodes' own outcomes can differ
        (one node's run failed after the other's finished, a command that fails on one node
        only), and a node retrying alone waits out the rendezvous for a node 0 that stopped.
        Node 0's attempt can end minutes after this node's (its ranks wait out --hang-timeout for
        a peer of this node that died): node 0 refreshes its record while its run lives
        (HEARTBEAT_S), and only a record that stands still for NODE0_WAIT_S (node 0's task gone)
        ends the wait, with this node's own outcome and no retry."""
        deadline, seen = time.monotonic() + NODE0_WAIT_S, None
        while time.monotonic() < deadline:
            now_seen = _stat(folder.state_file(mine.name))
            if now_seen != seen:  # node 0 wrote or refreshed it: its task lives
                deadline, seen = time.monotonic() + NODE0_WAIT_S, now_seen
            node0 = folder.read_state(mine.name)
            if node0 is not None and node0.attempts > mine.attempts:  # node 0 started the next
                mine.status = "failed"
                return mine
            if node0 is not None and node0.attempts == mine.attempts and node0.status != "running":
                mine.status, mine.note = node0.status, node0.note
                return mine
            time.sleep(0.5)
        self._node0_gone = True
        return mine

    # ----------------------------------------------------------------------- one attempt

    def _sweep(self) -> Sweep:
        folder = SweepFolder(Path(self.root))
        record = folder.read_sweep()
        if record is None:
            raise UsageError(f"{self.root}: no sweep.json; the sweep folder must be on a file "
                             "system the SLURM nodes share")
        spec = specs.SweepSpec(**record["spec"])
        opts = Options(metric=record.get("options", {}).get("metric"), timeout_s=self.timeout_s)
        return Sweep(spec, specs.expand(spec), folder, None, opts, echo=None)

    def _attempt(self, sweep: Sweep, run: specs.Run) -> RunState:
        folder = sweep.folder
        st = folder.read_state(run.name) or RunState(run.name, run.params)
        st.attempts = self._last_attempt = self._attempt_number(st)
        argv, resume = self._command(sweep, run, st.attempts)
        job, where = _job_id(), self._where()
        log_path = self._log_path(folder, run.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            log.write(f"\n=== attempt {st.attempts}, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                      f"SLURM job {job} on {where}: {shlex.join(argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=self._environment(folder),
                                          start_new_session=True, preexec_fn=self._child_setup())
        st.status, st.started, st.ended, st.exit_code = "running", time.time(), None, None
        st.pid, st.job, st.devices, st.note = None, job, self._devices_said(), ""
        st.job_start = _job_start()
        if self._node == 0:
            folder.write_state(st)
            self._record = folder.state_file(run.name) if self.nodes > 1 else None
            resumed = " (resuming from its checkpoint)" if resume else ""
            folder.event(f"start {run.name} as SLURM job {job} on {where}, attempt "
                         f"{st.attempts}{resumed}")
        code, timed_out = self._wait()
        st.ended, st.exit_code = time.time(), code
        classify(st, code, log_path, timed_out=timed_out, timeout_s=self.timeout_s,
                 stopped_by=REQUEUED if self._signalled and code != 0 else None)
        return st

    def _attempt_number(self, st: RunState) -> int:
        """The attempt this one is, from the run's record `st`: node 0 counts one more. Another
        node's attempt is the one node 0 counted in this start of the job (running, or already
        ended when this node started late), unless this node ran that one: then the next."""
        if self._node == 0:
            return st.attempts + 1
        counted = st.job_start == _job_start() and st.attempts > self._last_attempt
        return st.attempts if counted else max(st.attempts, self._last_attempt) + 1

    def _command(self, sweep: Sweep, run: specs.Run, attempt: int) -> tuple[list[str], str | None]:
        """(the run's command line on this node, its --resume). Node 0 prepares the run folder
        (attempts.prepare_folder); another node reads the same answer from it, without a change:
        node 0 moves aside only a folder without checkpoints, which resumes nothing either way."""
        folder = sweep.folder
        out = folder.run_dir(run.name)
        values = {"out": str(out), "devices": self.devices, "port": str(ports.free_port())}
        if self.nodes > 1:
            values["port"] = values["master_port"] = str(shared_port())
        if self._node == 0:
            values["resume"] = prepare_folder(folder, sweep.spec, run, attempt)
        elif specs.subcommand(sweep.spec.command) == "train":
            values["resume"] = str(out) if any(checkpoints_folder(out).glob("*.pt")) else None
        argv = specs.multigpu_prefix(specs.argv_for(sweep.spec, run, values))
        return argv, values.get("resume")

    def _log_path(self, folder: SweepFolder, name: str) -> Path:
        path = folder.run_log(name)
        return path if self._node == 0 else path.with_name(f"{name}.node{self._node}.log")

    def _where(self) -> str:
        if self.nodes > 1:
            return f"{self.nodes} nodes ({os.environ.get('SLURM_JOB_NODELIST', '?')})"
        return socket.gethostname()

    def _devices_said(self) -> str:
        if self.nodes > 1:
            return f"{self._where()}, {self.devices} each"
        return f"{socket.gethostname()} ({self.devices})"

    def _child_setup(self):
        setup = child_setup(None)
        if self.nodes == 1:
            return setup

        def deaf_to_the_step_signal():  # SLURM's SIGUSR2 is for this task alone
            setup()
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return deaf_to_the_step_signal

    def _environment(self, folder: SweepFolder) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder.compile_cache.resolve()))
        if self.devices.startswith("cpu:"):  # as the local pool's CPU runs: no GPU, one thread each
            env["CUDA_VISIBLE_DEVICES"] = ""
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _wait(self) -> tuple[int, bool]:
        """The run's exit code, and whether --timeout stopped it (SIGTERM, then SIGKILL after
        the grace period)."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else None
        timed_out, termed_at, beat = False, None, time.monotonic()
        while True:
            try:
                return self._proc.wait(timeout=min(1.0, HEARTBEAT_S)), timed_out
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self._record is not None and now - beat >= HEARTBEAT_S:  # the other nodes wait on it
                beat = now
                with contextlib.suppress(OSError):
                    os.utime(self._record)
            if deadline is not None and now > deadline and termed_at is None:
                timed_out, termed_at = True, now
                self._signal_run(signal.SIGTERM)
            elif termed_at is not None and now - termed_at > self.grace_s:
                self._signal_run(signal.SIGKILL)

    def _on_signal(self, signum, _frame) -> None:
        if not self._signalled:
            self._signalled = True
            self._signal_run(signal.SIGUSR1)  # what multigpu train stops on with a checkpoint

    def _signal_run(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                pass


def node_rank(nodes: int) -> int:
    """This task's node in the job (SLURM_NODEID, as the launcher reads it); 0 for one node."""
    return int(os.environ.get("SLURM_NODEID") or 0) if nodes > 1 else 0


def shared_port() -> int:
    """The rendezvous port of a run of several nodes: every node computes it alone from the
    job's id, and two runs whose node 0 share a machine get different ones (15000 + the id's
    last four digits, as Lightning's SLURM environment picks MASTER_PORT)."""
    job = os.environ.get("SLURM_JOB_ID", "")
    return 15000 + int(job[-4:]) if job.isdigit() else DEFAULT_PORT


def _stat(path: Path) -> tuple | None:
    """What changes when node 0 writes or refreshes its record (each node's own clock compares
    nothing: only a change is looked for)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ino, st.st_size


def _job_start() -> str:
    """This start of the job: its id and how often SLURM requeued it (the id stays)."""
    return f"{_job_id()}#{os.environ.get('SLURM_RESTART_COUNT') or 0}"


def _job_id() -> str:
    """1234_5 for an array's task, else the job's id."""
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{index}" if array and index else os.environ.get("SLURM_JOB_ID", "?")
