"""What a launch holds whatever its machines (launch.launch): the launch as one value, the
environment of ours the ranks get, and the lines that say how a launch ended. Torch-free.
"""
from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from multigpu.core.system import orphans
from multigpu.launcher.rank import watchdog
from multigpu.launcher.devices import DevicePlan
from multigpu.launcher.launch_failures import err, say_next_step
from multigpu.launcher.launch_options import LaunchOptions
from multigpu.launcher.ports import Rendezvous, parse_nnodes


@dataclass(frozen=True)
class Reporting:
    """Who says what when the ranks end, for launch.launch.
    `on_usage_error`: called when the ranks stopped on bad input, said in one line (exit 2);
    only for a command that is one of multigpu's own (launch_failures.report_child_failed).
    `next_step`: the line (if any) that says how to go on after a failure the ranks could not
    say themselves (a rank killed, a second signal that killed them at once).
    `ranks_say_their_stop`: rank 0 says how the ranks stopped after a stop signal (multigpu
    train: where, and the checkpoint to go on from); then the launcher of rank 0's node adds no
    line of its own when every rank of the node stopped by itself.
    `our_worker`: the command runs one of multigpu's workers (multigpu.launcher.rank.worker, or
    --auto's, which the caller names: the launcher never names a module of a layer above it),
    which says its own errors."""
    on_usage_error: Callable[[], None] | None = None
    next_step: Callable[[], str | None] | None = None
    ranks_say_their_stop: bool = False
    our_worker: bool = False

    @property
    def ours(self) -> bool:
        """Whether the ranks run multigpu's own commands (their echoes left to the report)."""
        return self.on_usage_error is not None or self.our_worker


@dataclass
class LaunchRun:
    """One launch, as launch.launch was asked for it (its arguments say what each is)."""
    cmd: list[str]
    plan: DevicePlan
    opts: LaunchOptions
    rdzv: Rendezvous
    log_dir: str
    python: bool = True
    reporting: Reporting = field(default_factory=Reporting)
    # --min-devices: the command for n devices (None: the same) and what the restart line adds
    reshape: Callable[[int], tuple[list[str] | None, str]] | None = None


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
    """The environment every rank inherits from the launcher; ours is restored afterwards."""
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
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_command(cmd: list[str]) -> None:
    """UsageError for a command that names nothing to run."""
    from multigpu.core.errors import UsageError

    if not cmd:
        raise UsageError("nothing to launch: give a script or -m module")
    if cmd[0] == "-m" and len(cmd) < 2:
        raise UsageError("-m needs a module name, e.g. -m mypackage.train")


def shows_rank_0(opts: LaunchOptions) -> bool:
    """Whether this node's console shows rank 0: one machine, or the node given --node-rank 0
    (torch's rendezvous numbers the nodes, most often in the order they joined: a guess)."""
    return parse_nnodes(opts.nnodes)[1] == 1 or opts.node_rank == 0


def stopped(sig: signal.Signals, signals, wait: float, next_step: Callable[[], str | None] | None,
            said_by_the_ranks: bool = False) -> int:
    """The launch was stopped by `sig` (and stopped the ranks, waiting up to `wait` s for them):
    said in one line, unless the ranks said it (`said_by_the_ranks`) and stopped in time; the
    exit code. `signals`: the signals counted (.signals, .waited_out(wait))."""
    from multigpu.launcher.sessions import kill_workers_left

    at_once = kill_workers_left() or signals.signals > 1
    waited_out = not at_once and signals.waited_out(wait)
    if said_by_the_ranks and not (at_once or waited_out):
        return 128 + int(sig)
    err(f"stopped by {sig.name}; every rank of this node was stopped"
        + (" (a second signal: killed at once)" if at_once else "")
        + (f" (killed: they had not stopped {wait} s after the signal)" if waited_out else ""))
    if at_once or waited_out:  # else the ranks stopped after a checkpoint and said so
        say_next_step(next_step)
    return 128 + int(sig)


def stopped_by_the_ranks(code: int, opts: LaunchOptions) -> int:
    """A stop signal sent to a rank, not to the launcher (`kill PID`): the ranks stopped together
    and rank 0 said where and how to go on; another node's launcher says what its ranks did."""
    if not shows_rank_0(opts):
        err(f"stopped: every rank of this node stopped on {signal.Signals(code - 128).name} (sent "
            "to a rank); rank 0's node says where and how to go on")
    return code


def node_name(opts: LaunchOptions) -> str | None:
    """'node 1 (gpu-b07)' in a launch of several nodes, None on one machine."""
    if parse_nnodes(opts.nnodes)[1] == 1:
        return None
    import socket

    rank = "?" if opts.node_rank is None else opts.node_rank
    return f"node {rank} ({socket.gethostname()})"
