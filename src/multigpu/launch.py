"""Start one process per device, on one machine or several, through torchrun's elastic agent.

Every launch goes through `torch.distributed.run`: we build a torchrun command line, parse it with
torchrun's own parser and call `torch.distributed.run.run(args)` in this process. In-process rather
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

Logs: local rank 0 writes to this console as usual; the other ranks' stdout/stderr go to
<log-dir>/<rdzv-id>_*/attempt_<n>/<local rank>/{stdout,stderr}.log. With --tee every rank is shown
with a "[rankN]:" prefix (and still logged). When a rank fails we print which rank failed first
and the end of its traceback.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from multigpu import ports, sysinfo
from multigpu.ports import BACKEND_NAME, DEFAULT_PORT, Rendezvous, parse_nnodes, plan_rendezvous
from multigpu.devices import DevicePlan
from multigpu.errors import UsageError

# Rules of our GPU machines: NVLink SHARP / multicast stays off (set unless the user set them).
GPU_MACHINE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class LaunchOptions:
    nnodes: str = "1"  # "N" or "MIN:MAX" (elastic)
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    start_timeout: float = 300.0  # seconds for the rendezvous to complete
    max_restarts: int = 0
    tee: bool = False  # show every rank's output with a rank prefix
    log_dir: str | None = None  # per-rank logs go here (default: runs/logs/<time>-<pid>)


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
                   help="where per-rank logs go (default runs/logs/<time>-<pid>)")


def options_from_args(args) -> LaunchOptions:
    """LaunchOptions from parsed flags, filled in from SLURM when run inside a multi-node step."""
    opts = LaunchOptions(
        nnodes=args.nnodes or "1", node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        start_timeout=args.start_timeout, max_restarts=args.max_restarts, tee=args.tee,
        log_dir=args.log_dir)
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
    if opts.tee:
        argv += ["--tee", "3"]
    elif plan.nproc > 1:  # local rank 0 keeps the console (a tty: colours, progress bars)
        argv += ["--redirects", ",".join(f"{r}:3" for r in range(1, plan.nproc))]
    if not python:
        argv.append("--no-python")
    elif cmd[0] == "-m":
        if len(cmd) < 2:
            raise UsageError("-m needs a module name, e.g. -m mypackage.train")
        argv.append("--module")
        cmd = cmd[1:]
    return argv + list(cmd)


@contextlib.contextmanager
def child_environment(plan: DevicePlan, opts: LaunchOptions):
    """The environment the agent copies into every worker; ours is restored afterwards."""
    saved = dict(os.environ)
    try:
        cvd = plan.cuda_visible_devices()
        if cvd is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = cvd
        for key, value in GPU_MACHINE_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # ids as nvidia-smi shows them
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // plan.nproc)))
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
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


@contextlib.contextmanager
def _restore_signal_handlers():
    """The agent replaces SIGINT/SIGTERM/... handlers while workers run; put ours back after."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, h in saved.items():
            with contextlib.suppress(ValueError, TypeError):  # not in the main thread
                signal.signal(s, h)


@contextlib.contextmanager
def _quiet_torchelastic():
    """torchrun logs its own banners and failure dumps; we print one summary instead."""
    import logging

    # torch's elastic modules set a level on their own loggers, so the parent's is not enough.
    names = ["torch.distributed.elastic"] + [n for n in logging.root.manager.loggerDict
                                              if n.startswith("torch.distributed.elastic.")]
    saved = {n: logging.getLogger(n).level for n in names}
    if not os.environ.get("MULTIGPU_DEBUG"):
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)


# --------------------------------------------------------------------------- launching

def launch(cmd: list[str], plan: DevicePlan, opts: LaunchOptions, *, python: bool = True) -> int:
    """Run `python <cmd>` (or `<cmd>` when python=False) on every device of `plan`, through
    torch.distributed.run; returns the exit code (non-zero when any rank failed)."""
    rdzv = plan_rendezvous(opts)
    if rdzv.named_port:
        ports.check_named_port(*rdzv.named_port)
    log_dir = opts.log_dir or default_log_dir()
    argv = torchrun_argv(cmd, plan, opts, rdzv, log_dir, python=python)
    print(f"multigpu: {header(plan, opts, rdzv, log_dir)}", file=sys.stderr, flush=True)

    # torch is imported here, after the checks, so that user mistakes are reported at once.
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    ports.register_rendezvous_backend()
    ports.OBSERVER.reset()
    with child_environment(plan, opts), _restore_signal_handlers(), _quiet_torchelastic():
        args = torchrun.get_args_parser().parse_args(argv)
        try:
            torchrun.run(args)
            return 0
        except ChildFailedError as exc:
            return report_child_failed(exc, log_dir)
        except SignalException as exc:
            _err(f"stopped by {exc.sigval.name}; every rank of this node was stopped")
            return 128 + int(exc.sigval)
        except RendezvousTimeoutError:
            _err(f"error: {rendezvous_timeout_message(opts, rdzv, ports.OBSERVER.joined())}")
            return 1
        except RendezvousError as exc:
            _err(f"error: {rendezvous_failed_message(exc, opts, rdzv)}")
            return 1


def _err(msg: str) -> None:
    print(f"multigpu: {msg}", file=sys.stderr, flush=True)


def header(plan: DevicePlan, opts: LaunchOptions, rdzv: Rendezvous, log_dir: str) -> str:
    _, hi = parse_nnodes(opts.nnodes)
    node = "?" if opts.node_rank is None else opts.node_rank
    where = "" if hi == 1 else f" on node {node} of {opts.nnodes}, rendezvous {rdzv.endpoint}"
    shown = "every rank shown" if opts.tee else "rank 0 shown here"
    return f"{plan.describe()}{where}; {shown}, all ranks logged in {log_dir}"


# --------------------------------------------------------------------------- failure messages

def _checks(opts: LaunchOptions, rdzv: Rendezvous) -> str:
    slurm = (" Under SLURM start it with srun --ntasks-per-node=1."
             if "SLURM_JOB_ID" in os.environ else "")
    return (f"Check that every node runs the same command with --nnodes {opts.nnodes} and the same "
            f"rendezvous {rdzv.endpoint}, that this address and port are reachable from every node "
            f"(firewall), and that each node has its own --node-rank 0..N-1.{slurm}")


def rendezvous_timeout_message(opts: LaunchOptions, rdzv: Rendezvous, joined: list[str]) -> str:
    lo, _ = parse_nnodes(opts.nnodes)
    seen = (f"{len(joined)} of {lo} nodes joined ({', '.join(n.rsplit('_', 2)[0] for n in joined)})"
            if joined else f"fewer than {lo} nodes joined")
    return (f"the rendezvous at {rdzv.endpoint} did not complete within --start-timeout "
            f"{opts.start_timeout:g} s: {seen}, expected {opts.nnodes}. {_checks(opts, rdzv)}")


def rendezvous_failed_message(exc: BaseException, opts: LaunchOptions, rdzv: Rendezvous) -> str:
    inner = exc.__cause__ or exc  # torchrun wraps the store's error; its first line says it
    cause = (str(inner).strip().splitlines() or [type(inner).__name__])[0].rstrip(".")
    port = rdzv.endpoint.rsplit(":", 1)[-1]
    full = str(inner)
    if "address already in use" in full.lower() or "EADDRINUSE" in full:
        holder = ports.port_holder(int(port)) if port.isdigit() else None
        return (f"port {port} of the rendezvous {rdzv.endpoint} is already in use"
                f"{f' (held by {holder})' if holder else ''}; name another port with "
                "--master-port, or leave it out on a single machine")
    return (f"could not reach the rendezvous at {rdzv.endpoint} ({cause}). "
            f"Node 0 must be started and listening there. {_checks(opts, rdzv)}")


_COLLATERAL = re.compile(r"gloo|nccl|DistBackendError|DistNetworkError|Connection (reset|closed)|"
                         r"Broken pipe|ProcessGroup|timed out|SIGTERM", re.IGNORECASE)


def report_child_failed(exc, log_dir: str) -> int:
    """Print which rank failed first and its traceback; return the exit code to use."""
    failures = list(exc.failures.items())  # in the order the agent saw them fail
    texts = {rank: _failure_text(f, log_dir) for rank, f in failures}

    def blame(item) -> tuple[int, int]:
        rank, f = item
        text = texts[rank]
        if f.exitcode < 0:  # killed by a signal: usually stopped by the agent after another died
            score = 3
        elif text is None:  # its output is on the console, we cannot read it
            score = 1
        else:  # a communication error in one rank is most often the echo of a crash elsewhere
            score = 2 if _COLLATERAL.search(text.splitlines()[-1] if text else "") else 0
        return score, failures.index(item)

    rank, first = min(failures, key=blame)
    what = _how(first).replace("exit", "exit code")
    lines = [f"rank {rank} failed first ({what}, local rank {first.local_rank}, pid {first.pid})"]
    if texts[rank]:
        lines.append(f"---- rank {rank} traceback ----\n{texts[rank]}\n----")
    elif _stderr_logs(log_dir, first.local_rank):
        lines.append("it wrote no traceback to stderr; see its logs")
    else:
        lines.append("its traceback is in its output above")
    others = [f"rank {r} ({_how(f)})" for r, f in failures if r != rank]
    if others:
        lines.append("also stopped: " + ", ".join(others))
    lines.append(f"logs of every rank: {log_dir}")
    _err("\nmultigpu: ".join(lines))
    return first.exitcode if first.exitcode > 0 else 128 + abs(first.exitcode)


def _failure_text(failure, log_dir: str, max_lines: int = 60) -> str | None:
    """The error a failed rank left: its error file (@record) or the end of its stderr log."""
    data = getattr(failure, "error_file_data", None) or {}
    msg = data.get("message")
    if isinstance(msg, dict):
        tb = (msg.get("extraInfo") or {}).get("py_callstack")
        return str(tb or msg.get("message") or "").rstrip() or None
    if isinstance(msg, str) and msg and msg != "<NONE>":  # "<NONE>": torchrun's "no error file"
        return msg.rstrip()
    logs = _stderr_logs(log_dir, failure.local_rank)
    if not logs:
        return None
    text = logs[-1].read_text(errors="replace").rstrip()
    start = text.rfind("Traceback (most recent call last)")
    lines = (text[start:] if start >= 0 else text).splitlines()
    return "\n".join(lines[-max_lines:]) or None


def _stderr_logs(log_dir: str, local_rank: int) -> list[Path]:
    """stderr.log files of a local rank, oldest attempt first (none: it wrote to the console)."""
    return sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"),
                  key=lambda p: p.stat().st_mtime)


def _how(failure) -> str:
    return (f"signal {failure.signal_name()}" if failure.exitcode < 0
            else f"exit {failure.exitcode}")
