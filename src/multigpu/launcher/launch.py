"""Start one process per device, on one machine or several, through torchrun's elastic agent.

Every launch goes through `torch.distributed.run`: we build a torchrun command line, parse it with
torchrun's own parser, turn it into torchrun's LaunchConfig (`config_from_args`) and run that with
`elastic_launch` in this process, as `torch.distributed.run.run(args)` does. In-process rather
than `python -m torch.distributed.run` so that failures reach us as objects, not text to parse:
ChildFailedError (which rank failed first, its exit code, its error file) and the rendezvous errors
(timeout, connection) become our own messages. The agent installs its SIGINT/SIGTERM handlers here,
in the main thread, and forwards the signal to every worker's process group.

Rendezvous, always torchrun's c10d backend (ports.py plans it):
  - one machine: the c10d store binds port 0, so the kernel picks a free port and many jobs can
    start at the same moment (no pick-then-bind race); workers reuse that store as MASTER_PORT.
  - several machines: the store lives on node 0 at --master-addr:--master-port (or
    --rdzv-endpoint); node 0 hosts it (is_host=1), the other nodes connect to it. Global ranks
    are given out by the rendezvous, so node 0 does not always hold rank 0.
  - --start-timeout bounds the rendezvous (join_timeout); when it expires we say how many nodes
    joined and what to check.

Logs: local rank 0 writes to this console only; the other ranks' stdout/stderr go to
<log-dir>/<rdzv-id>_*/attempt_<n>/<local rank>/{stdout,stderr}.log. That split is given to torch's
DefaultLogsSpecs as a mapping of local ranks, not as torchrun's `--redirects 1:3,2:3,...`, whose
parser takes one digit per rank (ranks 10 and up cannot be named there). With --tee every rank is shown
with a "[rankN]:" prefix (and still logged). When a rank fails we print which rank failed first
and the end of its traceback.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from multigpu.launcher import ports, sysinfo, watchdog
from multigpu.core import orphans
from multigpu.core.environ import environ_set
from multigpu.launcher.agent_hooks import (AGENT_STOP_WAIT, AttemptClose, RanksStopTogether,
                                           SecondSignalKills, kill_workers_left,
                                           quiet_torchelastic, restore_signal_handlers)
from multigpu.launcher.ports import BACKEND_NAME, DEFAULT_PORT, Rendezvous, parse_nnodes, plan_rendezvous
from multigpu.launcher.devices import DevicePlan
from multigpu.launcher.stop_reason import STOP_SIGNALS, each_stopped_by_itself
from multigpu.core.errors import UsageError
from multigpu.launcher.launch_options import AGENT_STARTED_ENV, LaunchOptions
from multigpu.launcher.launch_failures import (REPORTS_ENV, RestartsSaid, err, say_next_step, rendezvous_failed_message, rendezvous_timeout_message,
                                      report_child_failed)

def add_launch_arguments(parser) -> None:
    """The launch flags shared by `multigpu train` and `multigpu run`."""
    g = parser.add_argument_group("launch (one machine or several)")
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="machines taking part (default 1; inside a SLURM step: SLURM_NNODES)")
    g.add_argument("--node-rank", type=int, default=None, metavar="R",
                   help="this machine's rank, 0..N-1; node 0 hosts the rendezvous")
    g.add_argument("--master-addr", default=None, metavar="HOST",
                   help="address of node 0, reachable from every node")
    g.add_argument("--master-port", type=int, default=None, metavar="PORT",
                   help=f"rendezvous port on node 0 (several machines: default {DEFAULT_PORT}; "
                        "one machine: default a free port picked by the kernel)")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="same as --master-addr HOST --master-port PORT")
    g.add_argument("--rdzv-id", default=None, metavar="ID",
                   help="job id, equal on every node (default: the SLURM job id or 'multigpu')")
    g.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="fail when not every node has joined after this long (default 300)")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart all workers up to N times after a failure (default 0)")
    g.add_argument("--tee", action="store_true",
                   help="show every rank's output, prefixed with [rankN] (default: rank 0 only)")
    g.add_argument("--log-dir", default=None, metavar="DIR",
                   help="where per-rank logs go (default: the run folder's logs/ for multigpu "
                        "train, runs/logs/<time>-<pid> for multigpu run)")
    g.add_argument("--hang-timeout", type=float, default=watchdog.DEFAULT_HANG_TIMEOUT,
                   metavar="SECONDS",
                   help="when no rank has made progress for this long, write every rank's stack, "
                        "name where each one is stuck and stop (default "
                        f"{watchdog.DEFAULT_HANG_TIMEOUT:g}; 0: off)")


def options_from_args(args) -> LaunchOptions:
    """LaunchOptions from parsed flags, filled in from SLURM when run inside a multi-node step."""
    opts = LaunchOptions(
        nnodes=args.nnodes or "1", node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        start_timeout=args.start_timeout, max_restarts=args.max_restarts, tee=args.tee,
        log_dir=args.log_dir, hang_timeout=args.hang_timeout)
    ports.parse_nnodes(opts.nnodes)  # before anything is made for the run
    if opts.max_restarts < 0:
        raise UsageError(f"--max-restarts {opts.max_restarts}: must be 0 or more, e.g. --max-restarts 3")
    if not 0 < opts.start_timeout < float("inf"):
        raise UsageError(f"--start-timeout {args.start_timeout:g}: give seconds, more than 0, e.g. "
                         "--start-timeout 300")
    if not (opts.hang_timeout == 0 or 1 <= opts.hang_timeout < float("inf")):
        raise UsageError(f"--hang-timeout {args.hang_timeout:g}: give seconds (at least 1, e.g. "
                         "--hang-timeout 300), or 0 to turn the watchdog off")
    slurm = sysinfo.slurm_launch_defaults() if args.nnodes is None else {}
    if slurm:
        if slurm["tasks"] != int(slurm["nnodes"]):
            raise UsageError(f"this SLURM step runs {slurm['tasks']} tasks on {slurm['nnodes']} "
                             "nodes; multigpu starts the processes of a node itself, so start "
                             "one per node: srun --ntasks-per-node=1 multigpu ...")
        opts.nnodes = slurm["nnodes"]
        if opts.node_rank is None:
            opts.node_rank = slurm["node_rank"]
        if opts.master_addr is None and opts.rdzv_endpoint is None:
            opts.master_addr = slurm["master_addr"]
        opts.rdzv_id = opts.rdzv_id or slurm["rdzv_id"]
    return opts


def in_worker() -> bool:
    """True inside a process started by torchrun (ours or the user's)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


# --------------------------------------------------------------------------- building the command

def python_command(module: str, *args: str) -> list[str]:
    """`python -P -u -m MODULE ARGS` with this interpreter. -P: the current folder stays off
    sys.path, so a user's file named like a module of ours (multigpu.py) cannot shadow it."""
    return [sys.executable, "-P", "-u", "-m", module, *args]


def default_log_dir() -> str:
    return os.path.join("runs", "logs", f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def torchrun_argv(cmd: list[str], plan: DevicePlan, opts: LaunchOptions, rdzv: Rendezvous,
                  log_dir: str, *, python: bool = True) -> list[str]:
    """The torchrun command line (without `torchrun`) for `python <cmd...>` on every device."""
    if not cmd:
        raise UsageError("nothing to launch: give a script or -m module")
    argv = ["--nnodes", opts.nnodes, "--nproc-per-node", str(plan.nproc),
            "--rdzv-backend", BACKEND_NAME, "--rdzv-endpoint", rdzv.endpoint,
            "--rdzv-id", rdzv.run_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in rdzv.conf.items()),
            "--max-restarts", str(opts.max_restarts), "--log-dir", log_dir]
    if rdzv.endpoint == ports.LOOPBACK_ENDPOINT:
        argv += ["--local-addr", "127.0.0.1"]  # workers meet at the store on loopback
    if _torchrun_has("--signals-to-handle"):  # SLURM's --signal sends SIGUSR1 before the end
        argv += ["--signals-to-handle", STOP_SIGNALS]
    if opts.tee:
        argv += ["--tee", "3"]
    # else: local rank 0 keeps the console, the others write files (logs_specs, not --redirects)
    if not python:
        argv.append("--no-python")
    elif cmd[0] == "-m":
        if len(cmd) < 2:
            raise UsageError("-m needs a module name, e.g. -m mypackage.train")
        argv.append("--module")
        cmd = cmd[1:]
    return argv + list(cmd)


def launch_config(argv: list[str], plan: DevicePlan, opts: LaunchOptions, log_dir: str):
    """torchrun's (LaunchConfig, entrypoint, its args) for `argv` (torchrun_argv), with the logs
    split of the top (logs_specs)."""
    import torch.distributed.run as torchrun

    args = torchrun.get_args_parser().parse_args(argv)
    if args.master_port is None:  # as torchrun.run does (only its static rendezvous reads it)
        args.master_port = 29500
    with _cuda_counted_by_nvml():
        config, entrypoint, entry_args = torchrun.config_from_args(args)
    if not opts.tee and plan.nproc > 1:
        config.logs_specs = logs_specs(log_dir, plan.nproc)
    return config, entrypoint, entry_args


NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _cuda_counted_by_nvml():
    """torch's CUDA checks through NVML while torchrun's LaunchConfig is made: it asks
    torch.cuda.is_available() and device_count() to pick a default NUMA binding (none outside
    Meta), and the default check starts the CUDA driver (cuInit) in the launcher, which never
    uses CUDA. The user's own setting of the variable is kept; ours is not passed to the ranks."""
    return environ_set({NVML_CUDA_CHECK: os.environ.get(NVML_CUDA_CHECK, "1")})


def logs_specs(log_dir: str, nproc: int):
    """Local rank 0 on this console (a tty: colours, progress bars), every other rank's stdout and
    stderr in files under `log_dir`; for any number of local ranks."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    return DefaultLogsSpecs(log_dir=log_dir, redirects={r: Std.ALL for r in range(1, nproc)})


def _torchrun_has(option: str) -> bool:
    import torch.distributed.run as torchrun

    return any(option in a.option_strings for a in torchrun.get_args_parser()._actions)


def _tell_foreign_libraries(plan: DevicePlan, opts: LaunchOptions) -> None:
    """A script written for HF Accelerate or Lightning Fabric under `multigpu run`: on GPUs both
    read torchrun's environment, but on CPU processes each would run alone (Accelerate needs
    cpu=True to go multi-process, Fabric counts one CPU device): N separate jobs, without a
    word. So they are told, through the variables they read, unless the user set them."""
    if plan.accelerator == "cpu":
        os.environ.setdefault("ACCELERATE_USE_CPU", "1")
        os.environ.setdefault("LT_ACCELERATOR", "cpu")
        os.environ.setdefault("LT_DEVICES", str(plan.nproc))
    if opts.nnodes.isdigit() and opts.nnodes != "1":
        os.environ.setdefault("LT_NUM_NODES", opts.nnodes)


@contextlib.contextmanager
def child_environment(plan: DevicePlan, opts: LaunchOptions, log_dir: str | None = None):
    """The environment the agent copies into every worker; ours is restored afterwards."""
    saved = dict(os.environ)
    try:
        os.environ[orphans.LAUNCHER_PID_ENV] = str(os.getpid())  # workers watch it (orphans.py)
        os.environ[watchdog.HANG_TIMEOUT_ENV] = f"{opts.hang_timeout:g}"
        if log_dir:
            os.environ[watchdog.LOG_DIR_ENV] = str(Path(log_dir).resolve())
            # torch's NCCL flight recorder: record the last collectives, dump them on a timeout
            if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:  # its old name
                os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
            os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE",
                                  str(Path(log_dir).resolve() / "nccl_trace_rank_"))
        if not _torchrun_has("--signals-to-handle"):
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = STOP_SIGNALS
        cvd = plan.cuda_visible_devices()
        if cvd is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cvd
        # NCCL_*, NVSHMEM_* and TORCH_SYMM_MEM_* pass through as the user set them: no site rule
        # of ours (such as NVLink SHARP off) is imposed on anyone's machine.
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # ids as nvidia-smi shows them
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc)))
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        _tell_foreign_libraries(plan, opts)
        if opts.tee:
            os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
        if opts.max_restarts > 0:
            # Restarted workers reuse the rendezvous store they share with the agent, whose keys
            # still hold the dead group's addresses: gloo then connects to ports that are gone
            # (plain torchrun --standalone fails the same way, torch 2.13). A store per attempt
            # makes restarts work, at the price of torch picking that store's port with
            # bind-then-close, so only with --max-restarts.
            os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --------------------------------------------------------------------------- launching

def launch(cmd: list[str], plan: DevicePlan, opts: LaunchOptions, *, python: bool = True,
           on_usage_error: Callable[[], None] | None = None,
           next_step: Callable[[], str | None] | None = None,
           ranks_say_their_stop: bool = False) -> int:
    """Run `python <cmd>` (or `<cmd>` when python=False) on every device of `plan`, through
    torch.distributed.run; returns the exit code (non-zero when any rank failed).
    `on_usage_error`: called when the ranks stopped on bad input, said in one line (exit 2);
    only for a `cmd` that is one of multigpu's own commands (launch_failures.report_child_failed).
    `next_step`: the line (if any) that says how to go on after a failure the ranks could not
    say themselves (a rank killed, a second signal that killed them at once).
    `ranks_say_their_stop`: rank 0 says how the ranks stopped after a stop signal (multigpu
    train: where, and the checkpoint to go on from); then the launcher of rank 0's node adds no
    line of its own when every rank of the node stopped by itself."""
    rdzv = plan_rendezvous(opts)
    if rdzv.named_port:
        ports.check_named_port(*rdzv.named_port)
    log_dir = opts.log_dir or default_log_dir()
    argv = torchrun_argv(cmd, plan, opts, rdzv, log_dir, python=python)
    print(f"multigpu: {header(plan, opts, rdzv, log_dir)}", file=sys.stderr, flush=True)

    # torch is imported here, after the checks, so that user mistakes are reported at once.
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    ports.register_rendezvous_backend()
    ports.OBSERVER.reset()
    with _agent_tamed(plan, opts, log_dir, ranks_say_their_stop) as (signals, close):
        config, entrypoint, entry_args = launch_config(argv, plan, opts, log_dir)
        ours = on_usage_error is not None or _runs_our_worker(cmd)
        if ours:  # multigpu's own workers: leave their echoes to the report
            os.environ[REPORTS_ENV] = "1"
        began = time.time()
        os.environ[AGENT_STARTED_ENV] = repr(began)  # the workers' time: lines split the launch here
        try:
            elastic_launch(config, entrypoint)(*entry_args)
            return 0
        except ChildFailedError as exc:
            if ranks_say_their_stop and (code := each_stopped_by_itself(close.exit_codes)):
                return _stopped_by_the_ranks(code, opts)
            code = report_child_failed(exc, log_dir, node=_node_name(opts),
                                       on_usage_error=on_usage_error, since=began, ours=ours)
            if code != 2:  # 2: bad input, said in one line; nothing to go on from
                say_next_step(next_step)
            return code
        except SignalException as exc:
            said = ranks_say_their_stop and _shows_rank_0(opts) and \
                each_stopped_by_itself(close.exit_codes) == 128 + int(exc.sigval)
            return _stopped(exc.sigval, signals, getattr(config, "shutdown_timeout", None),
                            next_step, said_by_the_ranks=said)
        except RendezvousError as exc:  # a RendezvousTimeoutError too: the nodes did not all come
            timed_out = isinstance(exc, RendezvousTimeoutError)
            err("error: " + (rendezvous_timeout_message(opts, rdzv, ports.OBSERVER.joined())
                             if timed_out else rendezvous_failed_message(exc, opts, rdzv)))
            return 1
        except Exception as exc:  # torchrun's agent itself failed: one line, the logs say more
            if os.environ.get("MULTIGPU_DEBUG"):
                raise
            err(f"error: torchrun's agent failed ({type(exc).__name__}: {exc}); "
                 f"logs of every rank: {log_dir}")
            kill_workers_left()
            return 1


@contextlib.contextmanager
def _agent_tamed(plan: DevicePlan, opts: LaunchOptions, log_dir: str, ranks_stop_together: bool):
    """torch's agent as a launch runs it (agent_hooks): the workers' environment, its signal
    handlers and logs undone after, a second signal that kills at once, restarts said, and the
    attempts' close; yields (SecondSignalKills, AttemptClose)."""
    with child_environment(plan, opts, log_dir), restore_signal_handlers(), quiet_torchelastic(), \
            SecondSignalKills() as signals, RanksStopTogether(ranks_stop_together), \
            RestartsSaid(opts.max_restarts), \
            AttemptClose(asked_to_stop=lambda: signals.signals > 0,
                         ranks_stop_together=ranks_stop_together) as close:
        yield signals, close


def _stopped(sig: signal.Signals, signals: "SecondSignalKills", shutdown_timeout: float | None,
             next_step: Callable[[], str | None] | None, said_by_the_ranks: bool = False) -> int:
    """The agent was stopped by `sig` (and stopped the ranks): said in one line, unless the ranks
    said it (`said_by_the_ranks`) and stopped in time; the exit code."""
    at_once = kill_workers_left() or signals.signals > 1
    wait = shutdown_timeout or AGENT_STOP_WAIT
    waited_out = not at_once and signals.waited_out(wait)
    if said_by_the_ranks and not (at_once or waited_out):
        return 128 + int(sig)
    err(f"stopped by {sig.name}; every rank of this node was stopped"
        + (" (a second signal: killed at once)" if at_once else "")
        + (f" (killed: they had not stopped {wait} s after the signal)" if waited_out else ""))
    if at_once or waited_out:  # else the ranks stopped after a checkpoint and said so
        say_next_step(next_step)
    return 128 + int(sig)

# the modules `multigpu run` starts a Python script with (plain, and --auto), named, not imported
OUR_WORKERS = ("multigpu.launcher.worker", "multigpu.auto.worker")


def _runs_our_worker(cmd: list[str]) -> bool:
    """Whether `cmd` is `multigpu run`'s python_command(one of OUR_WORKERS, ...)."""
    return any(w in cmd[:6] and cmd[cmd.index(w) - 1] == "-m" for w in OUR_WORKERS)


def _shows_rank_0(opts: LaunchOptions) -> bool:
    """Whether this node's console shows rank 0: one machine, or the node given rank 0 (a node
    whose rank the rendezvous decides is not known to)."""
    return parse_nnodes(opts.nnodes)[1] == 1 or opts.node_rank == 0


def _stopped_by_the_ranks(code: int, opts: LaunchOptions) -> int:
    """A stop signal sent to a rank, not to the launcher (`kill PID`): the ranks stopped together
    and rank 0 said where and how to go on; another node's launcher says what its ranks did."""
    if not _shows_rank_0(opts):
        err(f"stopped: every rank of this node stopped on {signal.Signals(code - 128).name} (sent "
            "to a rank); rank 0's node says where and how to go on")
    return code


def _node_name(opts: LaunchOptions) -> str | None:
    """'node 1 (gpu-b07)' in a launch of several nodes, None on one machine."""
    if parse_nnodes(opts.nnodes)[1] == 1:
        return None
    import socket

    rank = "?" if opts.node_rank is None else opts.node_rank
    return f"node {rank} ({socket.gethostname()})"


def header(plan: DevicePlan, opts: LaunchOptions, rdzv: Rendezvous, log_dir: str) -> str:
    _, hi = parse_nnodes(opts.nnodes)
    node = "?" if opts.node_rank is None else opts.node_rank
    where = "" if hi == 1 else f" on node {node} of {opts.nnodes}, rendezvous {rdzv.endpoint}"
    # On a node other than 0 the first local process is not global rank 0: say which it is.
    if opts.tee:
        shown = f"every rank shown here and logged in {log_dir}"
    elif plan.nproc == 1:
        shown = "its output shown here"
    else:  # torchrun's --redirects: local rank 0 keeps the console, the others write files
        first = "rank 0" if hi == 1 else "this node's local rank 0"
        shown = f"{first} shown here, the other ranks logged in {log_dir}"
    return f"{plan.describe()}{where}; {shown}"
