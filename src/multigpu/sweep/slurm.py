"""`multigpu sweep --on slurm`: the sweep's runs as one SLURM job array, through submitit.

    multigpu sweep --on slurm --partition gpu --time 4h --devices-per-run 2 sweep.yaml

Each run that is not done becomes one task of one job array (submitit's map_array); the task
runs it into the same sweep folder as a local sweep would (slurm_task.py), so --status, the
summary and a re-run of the same command work as on one machine: a re-run submits only the runs
that are neither done nor still queued or running. The folder must be on a file system that the
nodes share. This command returns once the array is submitted; `--status` follows it.

Each task asks for --devices-per-run: N GPUs (sbatch --gpus-per-node=N) or cpu:N
(--cpus-per-task=N); --time is each job's time limit. SIGUSR1 comes 90 s before it; the run
checkpoints, the task is requeued and resumes (slurm_task.py), up to MAX_REQUEUES times.

--nodes-per-run N (N > 1): each task is a job of N nodes, and srun starts the run's task once
per node (one task a node, submitit's use_srun); each node's `multigpu train|run` joins the
others through the launcher's SLURM support (launcher/sysinfo.py). The batch shell then runs
srun, not Python, so the signal goes to the job's step (--signal=USR2@90, without B:), and SLURM
gives it to every process of the step on every node: the run's launcher and ranks too. Had it
been SIGUSR1, each rank would get it twice (from SLURM and from its launcher), and a second
SIGUSR1 stops `multigpu train` at once, without a checkpoint. So it is SIGUSR2, which the run's
processes ignore (slurm_task.py) and each node's task turns into one SIGUSR1 for its run.
Anything else sbatch takes: --slurm-arg account=abc --slurm-arg constraint=h100.

submitit is imported here only, so `multigpu` without the slurm extra is unchanged.
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from multigpu.core.errors import UsageError
from multigpu.core.system.extras import require
from multigpu.sweep.pool import parse_per_run
from multigpu.sweep.state import RunState, SweepFolder, format_duration

PREEMPT_SIGNAL = "USR1"  # what multigpu train stops on with a checkpoint (train/control.py)
STEP_SIGNAL = "USR2"  # several nodes: SLURM's signal to the whole step, that the run ignores
SIGNAL_DELAY_S = 90
MAX_REQUEUES = 100  # time limits a run may reach (submitit's max_num_timeout)
DEFAULT_TIME_S = 3600.0
NODE_OPTIONS = {"nodes", "ntasks_per_node", "ntasks"}  # --nodes-per-run sets them
RESERVED = {"setup", "use_srun", "additional_parameters", "signal_delay_s", "signal", "array",
            "array_parallelism", "job_name", "output", "error", "srun_args", "open_mode"}


@dataclass
class SlurmSettings:
    per_run: str = "1"  # --devices-per-run: GPUs, or cpu:N
    time_s: float = DEFAULT_TIME_S
    partition: str | None = None
    extra: dict = field(default_factory=dict)  # --slurm-arg, sbatch's long option names
    max_parallel: int | None = None
    nodes: int = 1  # --nodes-per-run

    def parameters(self, n_runs: int) -> dict:
        """submitit's SlurmExecutor parameters."""
        kind, n = parse_per_run(self.per_run)
        params = {"time": max(1, math.ceil(self.time_s / 60)), "nodes": self.nodes,
                  "ntasks_per_node": 1, "use_srun": self.nodes > 1, "signal_delay_s": SIGNAL_DELAY_S,
                  "array_parallelism": self.max_parallel or n_runs,
                  "setup": [f"export SUBMITIT_PREEMPT_SIGNAL={self.slurm_signal()}"]}
        params["cpus_per_task" if kind == "cpu" else "gpus_per_node"] = n
        if self.partition:
            params["partition"] = self.partition
        extra = {"requeue": True}
        valid = _valid_parameters()
        for key, value in self.extra.items():
            name = key.replace("-", "_")
            if name in NODE_OPTIONS:
                raise UsageError(f"--slurm-arg {key}: each run is a job of --nodes-per-run nodes "
                                 "(default 1), one task a node; give --nodes-per-run N instead")
            if name in RESERVED:
                raise UsageError(f"--slurm-arg {key}: the sweep sets it itself (the job array, "
                                 "its files, SIGUSR1 for the requeue); leave it out")
            if name in valid:
                params[name] = value
            else:
                extra[key.replace("_", "-")] = value
        # one node: B:, to the batch shell alone, which execs the task's Python (slurm_task.py
        # says why); several: the shell runs srun, so to the step, every process of it
        to = "" if self.nodes > 1 else "B:"
        extra["signal"] = f"{to}{self.slurm_signal()}@{SIGNAL_DELAY_S}"
        params["additional_parameters"] = extra
        return params

    def slurm_signal(self) -> str:
        """What SLURM sends before the time limit (the module's docstring says why two)."""
        return STEP_SIGNAL if self.nodes > 1 else PREEMPT_SIGNAL

    def describe(self) -> str:
        """"each run 2 GPUs, time limit 4h 00m" for the sweep's log."""
        kind, n = parse_per_run(self.per_run)
        what = f"{n} GPU{'s' if n > 1 else ''}" if kind == "cuda" else f"{n} CPU core{'s' if n > 1 else ''}"
        where = f" on partition {self.partition}" if self.partition else ""
        if self.nodes > 1:
            what = f"{self.nodes} nodes, {what} each"
        return f"each run {what}{where}, time limit {format_duration(self.time_s)}"

    def devices_arg(self) -> str:
        kind, n = parse_per_run(self.per_run)
        return f"cpu:{n}" if kind == "cpu" else str(n)


def parse_slurm_args(items) -> dict:
    """--slurm-arg K=V (or K alone, a flag) -> {K: V}; a sweep file may give a mapping."""
    if isinstance(items, dict):
        return {str(k): v for k, v in items.items()}
    found = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        key = key.strip().lstrip("-")
        if not key or " " in key:
            raise UsageError(f"--slurm-arg {item!r}: give sbatch's option as NAME=VALUE, e.g. "
                             "--slurm-arg account=myproject (or NAME alone for a flag)")
        found[key] = value.strip() if sep else True
    return found


def job_name(folder: SweepFolder) -> str:
    return f"sweep-{folder.root.name}"


def queued(folder: SweepFolder) -> set[str] | None:
    """The sweep's array tasks SLURM still has (pending, running, requeued), as 1234_5; None
    when squeue is not here or does not answer."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i", "--name", job_name(folder)],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return {line.strip() for line in out.stdout.splitlines() if line.strip()}


def todo(folder: SweepFolder, runs) -> tuple[list, int]:
    """(the runs to submit: neither done nor on SLURM's queue, the number still queued)."""
    live = queued(folder) or set()
    found, waiting = [], 0
    for run in runs:
        st = folder.read_state(run.name)
        if st is not None and st.status == "done":
            continue
        if st is not None and st.job and st.job in live:
            waiting += 1
            continue
        found.append(run)
    return found, waiting


def submit(folder: SweepFolder, runs, task, settings: SlurmSettings, echo=print) -> list[str]:
    """Submit `runs` (those to do) as one array of `task`; their states say pending with their
    job. Returns the job ids."""
    executor = _executor(folder, settings, len(runs))
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's error too
            jobs = executor.map_array(task, [r.name for r in runs])
    except Exception as exc:  # submitit's FailedJobError carries sbatch's stderr
        raise UsageError(_sbatch_error(exc, settings)) from None
    for run, job in zip(runs, jobs):
        st = folder.read_state(run.name) or RunState(run.name, run.params)
        st.status, st.job, st.pid = "pending", job.job_id, None
        st.note = f"queued as SLURM job {job.job_id}"
        folder.write_state(st)
    return [j.job_id for j in jobs]


def check_ready() -> None:
    """submitit and sbatch are here: said in one line before the sweep folder is touched."""
    require("submitit", "multigpu sweep --on slurm", "slurm")
    if shutil.which("sbatch") is None:
        raise UsageError("--on slurm: sbatch is not on PATH; submit from a machine of the SLURM "
                         "cluster (a login node), or leave out --on slurm to run the sweep here")


def _executor(folder: SweepFolder, settings: SlurmSettings, n_runs: int):
    check_ready()
    os.environ["SUBMITIT_PREEMPT_SIGNAL"] = settings.slurm_signal()  # before submitit reads it
    from submitit.slurm.slurm import SlurmExecutor, SlurmJobEnvironment

    SlurmJobEnvironment.USR_SIG = settings.slurm_signal()  # the #SBATCH --signal line reads it
    # one node: the batch shell execs Python, so that SIGUSR1 (B:) reaches the task and nothing
    # else; several: srun starts Python on each node (srun cannot start the shell's `exec`)
    python = shlex.quote(sys.executable)
    executor = SlurmExecutor(folder=folder.root / "slurm", max_num_timeout=MAX_REQUEUES,
                             python=python if settings.nodes > 1 else "exec " + python)
    try:
        executor.update_parameters(job_name=job_name(folder), **settings.parameters(n_runs))
    except ValueError as exc:
        raise UsageError(f"--slurm-arg: {str(exc).splitlines()[0]}") from None
    return executor


def _sbatch_error(exc: Exception, settings: SlurmSettings) -> str:
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    line = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else repr(exc))
    line = line.replace("sbatch: error: ", "")
    fatal = next((ln for ln in lines if ln.startswith("sbatch: fatal: ")), None)
    if fatal is not None and "configuration" in fatal:  # no slurm.conf: not a SLURM machine
        return (f"--on slurm: sbatch finds no SLURM cluster from here "
                f"({fatal.removeprefix('sbatch: fatal: ')}); submit from a login node of the "
                "cluster (or set SLURM_CONF to its slurm.conf), or leave out --on slurm to run "
                "the sweep here")
    if "contact slurm controller" in line.lower() or "connection refused" in line.lower():
        return (f"--on slurm: sbatch cannot reach the SLURM controller (slurmctld): {line}; "
                "check that it runs (scontrol ping) and that SLURM_CONF names this cluster")
    kind, n = parse_per_run(settings.per_run)
    if kind == "cuda" and "generic resource" in line.lower():  # gres: no GPUs where it would go
        return (f"--on slurm: sbatch refused the job array: {line}: each run asks for {n} "
                f"GPU{'s' if n > 1 else ''} (--devices-per-run: 1 GPU unless given), "
                "which that partition's nodes do not offer; name a partition with GPUs "
                "(--partition), or give CPU runs --devices-per-run cpu:N")
    return (f"--on slurm: sbatch refused the job array: {line}; check --partition, --time, "
            "--devices-per-run and --slurm-arg")


def _valid_parameters() -> set[str]:
    from submitit.slurm.slurm import SlurmExecutor

    return set(SlurmExecutor._valid_parameters())
