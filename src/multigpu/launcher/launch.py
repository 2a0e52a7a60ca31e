"""Start one process per device, on one machine or several.

The launcher starts and watches the ranks of its machine itself (local_loop), with torch's
public API only: one process per rank in a session of its own, with the environment torch's
agent gives a worker (local_rendezvous). One machine (--nnodes 1): a fresh store on 127.0.0.1
per attempt, its port picked by the kernel as it binds (no pick-then-bind race: many jobs can
start at the same moment). Several machines: each attempt the nodes meet in torch's c10d
rendezvous (node_rendezvous; node 0 hosts it, ports.plan_rendezvous), which numbers the nodes and
their ranks; a node waiting there (restarting, or joining) restarts every node's ranks.

Either way the rules are the same: which rank failed first and the end of its traceback, the
others told why they are stopped (stop_reason), --max-restarts restarts said, a stop signal
passed on to every rank (30 s to end, TORCH_ELASTIC_SHUTDOWN_TIMEOUT), a second one that kills
at once, what is left of a failed rank's session killed.

Logs: local rank 0 writes to this console only; the other ranks' stdout/stderr go to
<log-dir>/<run id>_*/attempt_<n>/<local rank>/{stdout,stderr}.log, beside each rank's error.json
(laid out as torch's DefaultLogsSpecs lays them out: rank_logs). With --tee every rank is shown with a "[rankN]:" prefix
(and still logged).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

from multigpu.core.system.environ import environ_set
from multigpu.launcher import cluster_env, ports, sysinfo
from multigpu.launcher.rank import watchdog
from multigpu.launcher.launch_common import (LaunchRun, Reporting, check_command,  # noqa: F401
                                             child_environment, node_name, shows_rank_0, stopped,
                                             stopped_by_the_ranks)
from multigpu.launcher.ports import DEFAULT_PORT, Rendezvous, parse_nnodes, plan_rendezvous
from multigpu.launcher.devices import DevicePlan
from multigpu.launcher.health.lost_devices import devices_of, lost_device_policy, recoveries, recovery_line
from multigpu.launcher.sessions import kill_workers_left, stop_wait
from multigpu.launcher.rank.stop_reason import each_stopped_by_itself
from multigpu.core.errors import UsageError
from multigpu.launcher.launch_options import AGENT_STARTED_ENV, LaunchOptions
from multigpu.launcher.launch_failures import (REPORTS_ENV, err, rendezvous_failed_message,
                                               rendezvous_timeout_message, report_child_failed,
                                               say_next_step)


def add_launch_arguments(parser) -> None:
    """The launch flags shared by `multigpu train` and `multigpu run`."""
    g = parser.add_argument_group("launch (one machine or several)")
    g.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                   help="machines taking part (default 1; inside a SLURM step: SLURM_NNODES; "
                        "under Kubeflow Trainer or SkyPilot: PET_NNODES, SKYPILOT_NUM_NODES)")
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
    g.add_argument("--min-devices", type=int, default=None, metavar="M",
                   help="with --max-restarts: when a rank dies on an unhealthy device, restart on "
                        "the healthy ones while at least M are left (one machine; default: "
                        "restart on the same devices)")
    g.add_argument("--device-health", default=None, metavar="CMD",
                   help="with --min-devices: a command that prints the unhealthy devices (cuda:1 "
                        "or 1, cpu:1), asked after a rank died; GPUs are also checked through NVML")
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
    """LaunchOptions from parsed flags, filled in from SLURM when run inside a multi-node step, or
    from Kubeflow Trainer's or SkyPilot's variables (cluster_env) on several nodes."""
    opts = LaunchOptions(
        nnodes=args.nnodes or "1", node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        start_timeout=args.start_timeout, max_restarts=args.max_restarts, tee=args.tee,
        log_dir=args.log_dir, hang_timeout=args.hang_timeout,
        min_devices=getattr(args, "min_devices", None), device_health=getattr(args, "device_health", None))
    ports.parse_nnodes(opts.nnodes)  # before anything is made for the run
    if opts.max_restarts < 0:
        raise UsageError(f"--max-restarts {opts.max_restarts}: must be 0 or more, e.g. --max-restarts 3")
    _check_lost_device_flags(opts)
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
    elif args.nnodes is None and (cluster := cluster_env.cluster_launch_defaults()):
        _use_cluster(opts, cluster)
    return opts


def _check_lost_device_flags(opts: LaunchOptions) -> None:
    """--min-devices and --device-health, as far as they can be checked without the devices."""
    m = opts.min_devices
    if m is not None and m < 1:
        raise UsageError(f"--min-devices {m}: give 1 or more, the fewest devices the run may go "
                         "on with, e.g. --min-devices 2")
    if m is not None and opts.max_restarts < 1:
        raise UsageError(f"--min-devices {m} drops a lost device when the run restarts: give "
                         "--max-restarts N too, e.g. --max-restarts 2")
    if opts.device_health is not None and m is None:
        raise UsageError(f"--device-health {opts.device_health} is asked when a rank dies, to drop "
                         "a lost device: give --min-devices M too (with --max-restarts N)")
    if opts.device_health is not None and not opts.device_health.strip():
        raise UsageError("--device-health needs a command, e.g. --device-health ./gpu_health.sh")


def check_min_devices(opts: LaunchOptions, plan: DevicePlan) -> None:
    """--min-devices against the launch's devices: one machine, one process per device, and
    at most as many as the run has."""
    m = opts.min_devices
    if m is None:
        return
    if parse_nnodes(opts.nnodes)[1] > 1:
        raise UsageError(f"--min-devices {m} works on one machine; several nodes restart on the "
                         "same devices: leave --min-devices out")
    if plan.accelerator == "cuda" and plan.nproc != len(plan.gpu_ids):
        raise UsageError(f"--min-devices {m}: this run drives its {len(plan.gpu_ids)} GPUs from one "
                         "process, which has no device to drop; leave --min-devices out")
    if m > plan.nproc:
        raise UsageError(f"--min-devices {m}: the run has {plan.nproc} device"
                         f"{'s' if plan.nproc != 1 else ''}; give --min-devices {plan.nproc} or fewer")


def _use_cluster(opts: LaunchOptions, found: dict) -> None:
    """Kubeflow's or SkyPilot's launch facts (cluster_env), where no flag said otherwise; node 0's
    name waited for until it resolves."""
    opts.nnodes = found["nnodes"]
    if opts.node_rank is None:
        opts.node_rank = found["node_rank"]
    if opts.rdzv_endpoint is None:
        opts.master_addr = opts.master_addr or found.get("master_addr")
        opts.master_port = opts.master_port or found.get("master_port")
    opts.rdzv_id = opts.rdzv_id or found.get("rdzv_id")
    if opts.master_addr and opts.rdzv_endpoint is None and opts.master_addr == found.get("master_addr"):
        cluster_env.wait_for_master(opts.master_addr, found["master_name"], opts.start_timeout,
                                    lambda line: print(line, file=sys.stderr, flush=True))


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

# --------------------------------------------------------------------------- launching

NO_REPORTING = Reporting()  # a command not of ours: the launcher says how its ranks ended

def launch(cmd: list[str], plan: DevicePlan, opts: LaunchOptions, *, python: bool = True,
           reporting: Reporting = NO_REPORTING, reshape=None) -> int:
    """Run `python <cmd>` (or `<cmd>` when python=False) on every device of `plan`; returns the
    exit code (non-zero when any rank failed). `reporting`: who says what when the ranks end;
    `reshape(n)`: with --min-devices, the command for n devices (LaunchRun.reshape)."""
    check_min_devices(opts, plan)
    rdzv = plan_rendezvous(opts)
    if rdzv.named_port:
        ports.check_named_port(*rdzv.named_port)
    log_dir = opts.log_dir or default_log_dir()
    check_command(cmd)
    print(f"multigpu: {header(plan, opts, rdzv, log_dir)}", file=sys.stderr, flush=True)
    return _launch_here(LaunchRun(cmd, plan, opts, rdzv, log_dir, python, reporting, reshape))


def _several(run: LaunchRun) -> bool:
    return parse_nnodes(run.opts.nnodes)[1] > 1


def _launch_here(run: LaunchRun) -> int:
    """launch() on this machine: its ranks started and watched by local_loop (several machines:
    the nodes met in torch's rendezvous each attempt), their end said."""
    # torch is imported by the loop once the ranks are started (local_loop._serve: their imports
    # and ours at once), after the checks, so that user mistakes are reported at once.
    from multigpu.launcher import local_loop

    with child_environment(run.plan, run.opts, run.log_dir):
        if run.reporting.ours:  # multigpu's own workers: leave their echoes to the report
            os.environ[REPORTS_ENV] = "1"
        began = time.time()
        os.environ[AGENT_STARTED_ENV] = repr(began)  # the workers' time: lines split the launch here
        try:
            held = _named_port_held(run)  # noqa: F841 (held for the launch)
            with lost_device_policy(run) as lost, _nodes(run) as nodes:
                result = local_loop.run(_loop_spec(run, lost, nodes))
        except Exception as exc:  # the launcher itself failed: one line, the logs say more
            return _launcher_failed(exc, run)
        return _said(result, run, began)


@contextlib.contextmanager
def _nodes(run: LaunchRun):
    """Several machines: this node's side of torch's rendezvous (node_rendezvous), shut down for
    every node at the launch's end, torch's own log lines off meanwhile; one machine: None."""
    if not _several(run):
        yield None
        return
    from multigpu.launcher import node_rendezvous

    with node_rendezvous.quiet_torchelastic(), environ_set(node_rendezvous.HANDLER_ENV):
        nodes = node_rendezvous.NodeRendezvous(run.rdzv, run.opts.nnodes)
        try:
            yield nodes
        finally:
            nodes.shutdown()


def _launcher_failed(exc: Exception, run: LaunchRun) -> int:
    """The launcher itself failed (the nodes did not meet, a store could not be made): one
    line, what is left of the ranks killed; the exit code."""
    if os.environ.get("MULTIGPU_DEBUG"):
        raise exc
    opts, rdzv = run.opts, run.rdzv
    line = f"the launcher failed ({type(exc).__name__}: {exc}); logs of every rank: {run.log_dir}"
    if isinstance(exc, _StoreFailed):
        line = rendezvous_failed_message(exc, opts, rdzv)
    elif _several(run):
        from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousError,
                                                          RendezvousTimeoutError)

        if isinstance(exc, RendezvousTimeoutError):  # the nodes did not all come
            line = rendezvous_timeout_message(opts, rdzv, ports.OBSERVER.joined())
        elif isinstance(exc, RendezvousClosedError):
            line = (f"the rendezvous at {rdzv.endpoint} was closed: another node ended the run "
                    f"(its ranks failed with no restart left, or it was stopped); logs of this "
                    f"node's ranks: {run.log_dir}")
        elif isinstance(exc, RendezvousError):
            line = rendezvous_failed_message(exc, opts, rdzv)
    err(f"error: {line}")
    kill_workers_left()
    return 1


def _said(result, run: LaunchRun, began: float) -> int:
    """How local_loop's launch ended (a LoopResult), said; the exit code."""
    for rec in recoveries(run.log_dir, result.restarts, began):
        err(recovery_line(rec))
    reporting, opts = run.reporting, run.opts
    if result.stop.signals:
        sig = result.stop.sig
        said = reporting.ranks_say_their_stop and shows_rank_0(opts) and \
            each_stopped_by_itself(result.exit_codes) == 128 + int(sig)
        return stopped(sig, result.stop, stop_wait(), reporting.next_step, said_by_the_ranks=said)
    if result.ended_elsewhere:
        err(f"error: {result.ended_elsewhere}; every rank of this node was stopped (that node "
            f"says why); logs of this node's ranks: {run.log_dir}")
        return 1
    if not result.failures:
        return 0
    if reporting.ranks_say_their_stop and (code := each_stopped_by_itself(result.exit_codes)):
        return stopped_by_the_ranks(code, opts)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    code = report_child_failed(ChildFailedError(run.cmd[0], result.failures), run.log_dir,
                               node=node_name(opts), on_usage_error=reporting.on_usage_error,
                               since=began, ours=reporting.ours)
    if code != 2:  # 2: bad input, said in one line; nothing to go on from
        say_next_step(reporting.next_step)
    return code


class _StoreFailed(RuntimeError):
    """The store on the port the user named could not be made (the port taken meanwhile)."""


def _named_port_held(run: LaunchRun):
    """--master-port on one machine: a store on that port for the length of the launch, as
    torch's rendezvous held it; the ranks meet at a store of their own (local_rendezvous).
    Several machines: node 0's rendezvous store binds it (node_rendezvous)."""
    if run.rdzv.named_port is None or _several(run):
        return None
    from multigpu.launcher.local_rendezvous import named_port_store

    host, port = ports.parse_endpoint(run.rdzv.endpoint, DEFAULT_PORT)
    try:
        return named_port_store(host, port)
    except Exception as exc:
        raise _StoreFailed(str(exc)) from exc


def _loop_spec(run: LaunchRun, lost=None, nodes=None):
    """What local_loop runs: the logs split as the header says (local rank 0 on the console,
    the others in files; --tee: every rank on both)."""
    from multigpu.launcher.local_loop import LoopSpec
    from multigpu.launcher.rank_logs import RankLogs

    plan, opts = run.plan, run.opts
    logs = RankLogs(run.log_dir, redirected=set(range(1, plan.nproc)), tee=opts.tee)
    return LoopSpec(cmd=run.cmd, nproc=plan.nproc, run_id=run.rdzv.run_id, logs=logs,
                    max_restarts=opts.max_restarts, python=run.python, tee=opts.tee,
                    ranks_stop_together=run.reporting.ranks_say_their_stop,
                    our_worker=run.reporting.our_worker, devices=devices_of(plan), lost=lost,
                    nodes=nodes)


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

