"""Start the processes of this node of a launch of several machines, through torchrun's elastic
agent (one machine: local_loop).

We build a torchrun command line, parse it with torchrun's own parser, turn it into torchrun's
LaunchConfig (`config_from_args`) and run that with `elastic_launch` in this process, as
`torch.distributed.run.run(args)` does. In-process rather than `python -m torch.distributed.run`
so that failures reach us as objects, not text to parse: ChildFailedError (which rank failed
first, its exit code, its error file) and the rendezvous errors (timeout, connection) become our
own messages. The agent installs its SIGINT/SIGTERM handlers here, in the main thread, and
forwards the signal to every worker's process group. What the launcher adds to the agent
(a second signal that kills, restarts said, the attempts' close) is agent_hooks': private torch
API, on this path only (docs/torch-api.md).

Rendezvous, torchrun's c10d backend (ports.py plans it): the store lives on node 0 at
--master-addr:--master-port (or --rdzv-endpoint); node 0 hosts it (is_host=1), the other nodes
connect to it. Global ranks are given out by the rendezvous, so node 0 does not always hold rank
0. --start-timeout bounds the rendezvous (join_timeout); when it expires we say how many nodes
joined and what to check.

Logs: as on one machine (launch.py), through torch's DefaultLogsSpecs given as a mapping of local
ranks, not as torchrun's `--redirects 1:3,2:3,...`, whose parser takes one digit per rank.
"""
from __future__ import annotations

import contextlib
import os
import time

from multigpu.core.system.environ import environ_set
from multigpu.launcher import ports
from multigpu.launcher.agent_hooks import (AGENT_STOP_WAIT, AttemptClose, RanksStopTogether,
                                           SecondSignalKills, kill_workers_left,
                                           quiet_torchelastic, restore_signal_handlers)
from multigpu.launcher.devices import DevicePlan
from multigpu.launcher.launch_common import (LaunchRun, check_command, child_environment,
                                             logs_specs, node_name, shows_rank_0, stopped,
                                             stopped_by_the_ranks)
from multigpu.launcher.launch_failures import (REPORTS_ENV, RestartsSaid, err, rendezvous_failed_message,
                                               rendezvous_timeout_message, report_child_failed,
                                               say_next_step)
from multigpu.launcher.launch_options import AGENT_STARTED_ENV, LaunchOptions
from multigpu.launcher.ports import BACKEND_NAME, Rendezvous
from multigpu.launcher.rank.stop_reason import STOP_SIGNALS, each_stopped_by_itself


def torchrun_argv(cmd: list[str], plan: DevicePlan, opts: LaunchOptions, rdzv: Rendezvous,
                  log_dir: str, *, python: bool = True) -> list[str]:
    """The torchrun command line (without `torchrun`) for `python <cmd...>` on every device."""
    check_command(cmd)
    argv = ["--nnodes", opts.nnodes, "--nproc-per-node", str(plan.nproc),
            "--rdzv-backend", BACKEND_NAME, "--rdzv-endpoint", rdzv.endpoint,
            "--rdzv-id", rdzv.run_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in rdzv.conf.items()),
            "--max-restarts", str(opts.max_restarts), "--log-dir", log_dir]
    if _torchrun_has("--signals-to-handle"):  # SLURM's --signal sends SIGUSR1 before the end
        argv += ["--signals-to-handle", STOP_SIGNALS]
    if opts.tee:
        argv += ["--tee", "3"]
    # else: local rank 0 keeps the console, the others write files (logs_specs, not --redirects)
    if not python:
        argv.append("--no-python")
    elif cmd[0] == "-m":
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


def _torchrun_has(option: str) -> bool:
    import torch.distributed.run as torchrun

    return any(option in a.option_strings for a in torchrun.get_args_parser()._actions)


def launch_with_agent(run: LaunchRun) -> int:
    """launch.launch through torch's elastic agent: the exit code."""
    plan, opts, rdzv, log_dir = run.plan, run.opts, run.rdzv, run.log_dir
    argv = torchrun_argv(run.cmd, plan, opts, rdzv, log_dir, python=run.python)
    # torch is imported here, after the checks, so that user mistakes are reported at once.
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    ports.register_rendezvous_backend()
    ports.OBSERVER.reset()
    with _agent_tamed(plan, opts, log_dir, run.reporting.ranks_say_their_stop) as (signals, close):
        config, entrypoint, entry_args = launch_config(argv, plan, opts, log_dir)
        if run.reporting.ours:  # multigpu's own workers: leave their echoes to the report
            os.environ[REPORTS_ENV] = "1"
        began = time.time()
        os.environ[AGENT_STARTED_ENV] = repr(began)  # the workers' time: lines split the launch here
        try:
            elastic_launch(config, entrypoint)(*entry_args)
            return 0
        except ChildFailedError as exc:
            if run.reporting.ranks_say_their_stop and (code := each_stopped_by_itself(close.exit_codes)):
                return stopped_by_the_ranks(code, opts)
            code = report_child_failed(exc, log_dir, node=node_name(opts),
                                       on_usage_error=run.reporting.on_usage_error, since=began,
                                       ours=run.reporting.ours)
            if code != 2:  # 2: bad input, said in one line; nothing to go on from
                say_next_step(run.reporting.next_step)
            return code
        except SignalException as exc:
            said = run.reporting.ranks_say_their_stop and shows_rank_0(opts) and \
                each_stopped_by_itself(close.exit_codes) == 128 + int(exc.sigval)
            wait = getattr(config, "shutdown_timeout", None) or AGENT_STOP_WAIT
            return stopped(exc.sigval, signals, wait, run.reporting.next_step, said_by_the_ranks=said)
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
    with child_environment(plan, opts, log_dir), _agent_environment(opts), \
            restore_signal_handlers(), quiet_torchelastic(), \
            SecondSignalKills() as signals, RanksStopTogether(ranks_stop_together), \
            RestartsSaid(opts.max_restarts), \
            AttemptClose(asked_to_stop=lambda: signals.signals > 0,
                         ranks_stop_together=ranks_stop_together) as close:
        yield signals, close


def _agent_environment(opts: LaunchOptions):
    """What only torch's agent needs in the workers' environment."""
    env = {}
    if not _torchrun_has("--signals-to-handle"):
        env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = STOP_SIGNALS
    if opts.max_restarts > 0:
        # Restarted workers reuse the rendezvous store they share with the agent, whose keys
        # still hold the dead group's addresses: gloo then connects to ports that are gone
        # (plain torchrun --standalone fails the same way, torch 2.13). A store per attempt
        # makes restarts work, at the price of torch picking that store's port with
        # bind-then-close, so only with --max-restarts.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return environ_set(env)
