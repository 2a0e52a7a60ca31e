"""The distributed state of one process, read once from the launcher's environment.

`DistEnv` is a small frozen value: rank, local rank, world size, device, backend. It is built by
`init_distributed()`, which is the only place in multigpu that creates a process group, and it is
passed explicitly to whatever needs it. Collectives that must be no-ops in a single process
(`all_reduce`, `barrier`, ...) are methods here, so callers never write `if world_size > 1`.
"""
from __future__ import annotations

import atexit
import datetime
import gc
import socket
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from multigpu.core.errors import Api, Text, UsageError

@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the run: rank, local rank, world size, device, backend.

    Made by `init_distributed()` (and so by `setup()`, as `rt.env`); frozen, passed explicitly.
    Fields: `rank` (global, 0..world_size-1), `local_rank` (on this machine; the GPU index),
    `world_size`, `local_world_size` (processes on this machine), `device`, `backend` ("nccl",
    "gloo", or None for one process without a group). The collectives below are no-ops in one
    process, so code written for N processes runs unchanged in one.

        env = rt.env
        total = env.all_reduce(torch.tensor([n_correct], device=env.device))
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: no process group (one process)

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part (a process group exists)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the one process that prints, logs and writes files."""
        return self.rank == 0

    # --- collectives: identity in one process ------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place sum/max/min over ranks; returns the tensor. A no-op with one process.

        Collective: every rank calls it with a tensor of the same shape, on its device.
        op: "sum", "max" or "min"."""
        if self.is_distributed:
            dist.all_reduce(tensor, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                                        "min": dist.ReduceOp.MIN}[op])
        return tensor

    def all_gather_object(self, obj):
        """A list with every rank's `obj`, in rank order (through host memory, never the GPU)."""
        if not self.is_distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=_CPU_GROUP)
        return out

    def broadcast_object(self, obj, src: int = 0):
        """Rank `src`'s `obj` on every rank (through host memory, never the GPU)."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=_CPU_GROUP)
        return box[0]

    def all_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum over ranks of small integers, exchanged on the CPU: no GPU
        work and no host-device sync, so a training loop can agree on decisions cheaply."""
        if not self.is_distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CPU_GROUP)
        return t.tolist()

    def broadcast_tensors(self, tensors, src: int = 0) -> None:
        """Overwrite each tensor, in place, with rank `src`'s: one broadcast per dtype and device
        (the tensors flattened into one), whatever their layout; CPU tensors of an NCCL run go
        through the gloo group. A no-op with one process."""
        if not self.is_distributed:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for (_, device), same in groups.items():
                flat = torch.cat([t.reshape(-1) for t in same])
                cpu_group = _CPU_GROUP if device.type == "cpu" else None
                dist.broadcast(flat, src=src, group=cpu_group)
                for t, part in zip(same, flat.split([t.numel() for t in same])):
                    t.copy_(part.view(t.shape))

    def barrier(self) -> None:
        """Wait until every rank has reached this call. A no-op with one process."""
        if self.is_distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not an integer; "
                         f"unset it or launch with `multigpu run`") from None


def launched_by_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _own_gpu(world_size: int, local_rank: int, gpu_index: int | None, own_gpu: bool) -> torch.device:
    """This process's GPU (see init_distributed), bound before any CUDA work, so NCCL and the
    caching allocator never touch GPU 0 by accident (the classic "every rank also allocates on
    GPU 0" bug)."""
    if world_size > 1 or launched_by_torchrun():
        if gpu_index is not None and world_size > 1:
            raise UsageError("a GPU index was given to setup() in a multi-process run; under "
                             "a launcher each process uses GPU LOCAL_RANK: choose GPUs with "
                             "`multigpu run --devices 0,3` instead")
        index = 0 if own_gpu else local_rank
    else:
        index = 0 if gpu_index is None else gpu_index
    if index >= torch.cuda.device_count():
        raise UsageError(f"this process wants GPU {index} but only {torch.cuda.device_count()} "
                         f"are visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                         f"start one process per GPU with `multigpu run --devices N`")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def init_distributed(accelerator: str = "auto", gpu_index: int | None = None,
                     timeout_minutes: float = 30.0, *, install_hooks: bool = False,
                     own_gpu: bool = False) -> DistEnv:
    """Read torchrun's environment, bind this process to its device, create the process group.

    - Under torchrun with WORLD_SIZE > 1: one process per device; NCCL on CUDA, gloo on CPU.
    - Plain `python train.py`: one process, no process group, on `cuda:gpu_index` (default 0) or CPU.

    `accelerator` is "auto", "cuda" or "cpu". Calling it again returns the existing group's state.
    `install_hooks`: also install_exit_hooks() (a program that owns its process asks for them);
    otherwise nothing process-wide changes but the group and the bound device.
    `own_gpu`: the launcher left each process only its own GPU visible (`multigpu run --auto`
    narrows CUDA_VISIBLE_DEVICES), so that GPU is cuda:0 whatever the local rank.
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)

    if _resolve_accelerator(accelerator):
        device, backend = _own_gpu(world_size, local_rank, gpu_index, own_gpu), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"

    if world_size == 1:
        return DistEnv(rank, local_rank, 1, 1, device, None)

    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
        if backend == "nccl":
            kwargs["device_id"] = device  # eager NCCL init, bound to this GPU
        dist.init_process_group(**kwargs)
        global _CPU_GROUP
        # Objects and loop decisions go through gloo on the CPU: with NCCL they would be copied to
        # the GPU and back, and wait behind the step's kernels.
        _CPU_GROUP = dist.new_group(backend="gloo") if backend == "nccl" else None
        if launched_by_torchrun():
            global _launcher_pid
            _launcher_pid = os.getppid()
    elif dist.get_world_size() != world_size:
        raise RuntimeError("a process group already exists with a different world size")
    if install_hooks:
        install_exit_hooks()
    return DistEnv(rank, local_rank, world_size, local_world_size, device,
                   dist.get_backend())


def nccl_group_with_max_ctas(max_ctas: int):
    """An NCCL process group over every rank whose kernels may use at most `max_ctas` thread
    blocks, i.e. SMs (NCCL's maxCTAs communicator setting). A collective called with it competes
    less with the compute running beside it, at the price of a slower collective alone. Made once
    per value and reused (each group holds NCCL buffers and threads); every rank must call it the
    same way, since creating a group is collective."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        raise UsageError(f"nccl_max_ctas={max_ctas} needs the NCCL backend (one process per GPU); "
                         "leave it unset on CPU")
    if max_ctas not in _CTA_GROUPS:
        options = dist.ProcessGroupNCCL.Options()
        options.config.max_ctas = max_ctas
        _CTA_GROUPS[max_ctas] = dist.new_group(backend="nccl", pg_options=options)
    return _CTA_GROUPS[max_ctas]


_CTA_GROUPS: dict[int, object] = {}  # max_ctas -> its group; emptied with the default group
_CPU_GROUP = None  # a gloo group over every rank when the default group is NCCL (else the default)


def _resolve_accelerator(accelerator: str) -> bool:
    """True when this process should use CUDA."""
    if accelerator not in ("auto", "cuda", "gpu", "cpu"):
        raise UsageError(f"accelerator {accelerator!r} is not known; use 'auto', 'cuda' or 'cpu'")
    if accelerator == "cpu":
        return False
    available = torch.cuda.is_available()
    if accelerator in ("cuda", "gpu") and not available:
        raise UsageError(Text("CUDA was requested but no GPU is visible to this process; use {}, "
                              "or check `multigpu gpus`",
                              Api("setup.accelerator", "cpu")))
    return available


def destroy_distributed(wait_for_peers: bool = False,
                        store: tuple[str | None, str | None] | None = None) -> None:
    """Tear down the process group, if any. `wait_for_peers`: with gloo, first wait (at most
    _EXIT_WAIT_SECONDS, on every rank) until every rank has got here, at the launcher's store
    (`store`: its address and port, default MASTER_ADDR and MASTER_PORT); see below."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_for_peers and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        _meet_before_teardown(dist.get_world_size(), *(store or (None, None)))
    global _CPU_GROUP
    _CTA_GROUPS.clear()
    _CPU_GROUP = None
    # A DDP model's reducer holds the group too. Freed while it is the group's last holder, it
    # destroys the group with the GIL held, and gloo's destructor then waits for its worker
    # threads, one of which may be waiting for the GIL to free its last collective's tensors: the
    # process never exits (seen at the end of 2-process CPU runs on a busy machine: the main
    # thread in ~ProcessGroupGloo's join, a gloo thread in ~AsyncWork waiting for the GIL).
    # So the DDP models nobody holds any more go first, while
    # the registry still holds the group, and the last holder is then our Python reference,
    # whose release torch runs with the GIL released.
    gc.collect()
    world = dist.group.WORLD
    dist.destroy_process_group()
    del world


# At exit, a gloo rank that tears its connections down while a peer is still finishing can abort
# after Python has shut down ("terminate called without an active exception", 2 in 42 runs of a
# 2-process CPU script here, with the group already destroyed at exit; none in 70 runs once the
# ranks met first). So on a clean exit the ranks first meet, through the launcher's key-value
# store rather than a collective: a store wait times out on every rank (a gloo barrier would block
# the ranks other than 0 for the group's whole timeout, 30 minutes, if one rank never comes).
# After an uncaught exception, a UsageError or a non-zero exit of the CLI they do not wait.
_EXIT_WAIT_SECONDS = 30
_failed = False
_hooks_installed = False
_launcher_pid: int | None = None  # the worker's parent, torchrun's agent, when the group was made


def _meet_before_teardown(world_size: int, addr: str | None = None, port: str | None = None) -> None:
    timeout = datetime.timedelta(seconds=_EXIT_WAIT_SECONDS)
    run = (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")  # a restart starts afresh
    try:
        store = launcher_store(addr or os.environ.get("MASTER_ADDR"),
                               port or os.environ.get("MASTER_PORT"), _EXIT_WAIT_SECONDS)
        if store is None:
            return
        if store.add(f"multigpu/exit/{run}/count", 1) == world_size:
            store.set(f"multigpu/exit/{run}/all", "1")
        store.wait([f"multigpu/exit/{run}/all"], timeout)
    except Exception:  # a rank that left early or died, or the store is gone: stop waiting
        pass


def launcher_gone() -> bool:
    """Whether the launcher that started this worker has died (the worker was re-parented)."""
    from multigpu.core.system import orphans

    return orphans.gone() or (_launcher_pid is not None and os.getppid() != _launcher_pid)


def launcher_store(addr: str | None, port: str | int | None, timeout: float):
    """A client of the launcher's key-value store at addr:port, or None when it is not there.

    TCPStore retries a refused connection for its whole timeout, twice: with the launcher dead
    (kill -9) that is a worker kept alive for 10-60 s at exit. So a plain connect is tried first,
    which a dead launcher's port refuses at once."""
    if not (addr and port) or launcher_gone():
        return None
    try:
        socket.create_connection((addr, int(port)), timeout=min(timeout, 2.0)).close()
    except OSError:
        return None
    return dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def mark_failed() -> None:
    """This process is ending on an error: do not wait for the other ranks at exit."""
    global _failed
    _failed = True


def install_exit_hooks() -> None:
    """For a program that owns its process (`multigpu train`, bench, the self-test; `multigpu
    run`'s worker does the same for a user's script): at exit, tear the process group down, after
    the ranks meet unless this process failed, and count an uncaught exception as a failure. A
    process that exits with its group alive can abort in the group's destructor ("terminate
    called without an active exception", seen with gloo). They replace sys.excepthook and add an
    atexit handler, so a library call never installs them unasked. Once per process."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_destroy_at_exit)
    _watch_uncaught_exceptions()


def _watch_uncaught_exceptions() -> None:
    import sys

    previous = sys.excepthook

    def hook(*args):
        mark_failed()
        previous(*args)

    sys.excepthook = hook


def _destroy_at_exit() -> None:
    destroy_distributed(wait_for_peers=not _failed)
