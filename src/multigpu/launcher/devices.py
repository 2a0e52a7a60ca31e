"""Which devices a run uses: the `--devices` grammar, shared by `multigpu train` and `multigpu run`.

    auto    every free GPU, or 1 CPU process when the machine has no GPU
    N       N GPUs, chosen among the free ones (GPU 0 busy -> `--devices 1` runs on GPU 1)
    0,3     exactly these GPU ids; `1,` (trailing comma) is GPU 1 alone
    cpu:N   N CPU processes on gloo, on any machine

A GPU is *free* when it has at least `--min-free-memory` GB free and no compute process of
anyone else on it (read through NVML, as `nvidia-smi` does), and no other multigpu process leased
it (leases.py: a sweep, or a train or run that is still starting). `--min-free-memory 0` turns
both checks off, for sharing a GPU on purpose. After the choice, `lease` takes the chosen GPUs for
the life of the process.

GPU ids are what this process sees: with a user-set CUDA_VISIBLE_DEVICES=2,3, id 0 is physical
GPU 2. Physical numbers follow NVML / nvidia-smi (PCI bus order); launched children get
CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA counts the same way.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from multigpu.launcher import leases
from multigpu.core.errors import UsageError

GIB = 1024**3

GRAMMAR = ("auto (every free GPU), N (N free GPUs, e.g. 2), 0,3 (exactly these GPU ids; "
           "1, for GPU 1 alone) or cpu:N (N CPU processes on gloo)")


@dataclass
class GpuInfo:
    """One GPU as NVML reports it. Memory in bytes; `index` is the NVML (nvidia-smi) index."""

    index: int
    name: str
    memory_used: int
    memory_total: int
    utilization: int | None = None  # percent, None when NVML cannot tell
    processes: list[tuple[int, str, int | None]] = field(default_factory=list)  # (pid, name, bytes)
    uuid: str = ""


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or queried: there is no usable NVIDIA driver."""


def query_gpus() -> list[GpuInfo]:
    """Every GPU of the machine, ignoring CUDA_VISIBLE_DEVICES. Raises NvmlUnavailable.

    Unit tests monkeypatch this function to fake GPUs.
    """
    try:
        import pynvml
    except ImportError as exc:  # nvidia-ml-py is a dependency, but keep `gpus` usable without it
        raise NvmlUnavailable("nvidia-ml-py is not installed") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML: {exc}") from exc
    try:
        return [_query_one(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(f"NVML: {exc}") from exc
    finally:
        pynvml.nvmlShutdown()


def _query_one(nv, index: int) -> GpuInfo:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    name = nv.nvmlDeviceGetName(h)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    try:
        util = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
    except nv.NVMLError:  # not supported on some parts (MIG, vGPU)
        util = None
    try:
        uuid = nv.nvmlDeviceGetUUID(h)
    except nv.NVMLError:
        uuid = ""
    try:
        procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
    except nv.NVMLError:
        procs = []
    processes = [(p.pid, _process_name(p.pid), p.usedGpuMemory) for p in procs]
    return GpuInfo(index, _text(name), int(mem.used), int(mem.total), util, processes, _text(uuid))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _process_name(pid: int) -> str:
    """Name (and user) of a process; in a container, NVML pids may not exist here."""
    try:
        import psutil

        p = psutil.Process(pid)
        return f"{p.name()} ({p.username()})"
    except Exception:
        return "?"


# --------------------------------------------------------------------------- visibility and state

@dataclass(frozen=True)
class VisibleGpu:
    id: int  # as this process sees it (relative to CUDA_VISIBLE_DEVICES)
    token: str  # what to put in the children's CUDA_VISIBLE_DEVICES
    info: GpuInfo


def user_cuda_visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def visible_gpus(gpus: list[GpuInfo], cvd: str | None) -> list[VisibleGpu]:
    """The GPUs CUDA would show under `cvd`, with the ids CUDA gives them.

    Like CUDA, the list stops at the first entry that names no GPU ("-1" hides everything).
    """
    if cvd is None:
        return [VisibleGpu(i, str(g.index), g) for i, g in enumerate(gpus)]
    by_index = {str(g.index): g for g in gpus}
    out: list[VisibleGpu] = []
    for token in (t.strip() for t in cvd.split(",")):
        if token in by_index:
            g = by_index[token]
        elif token.startswith("GPU-") and (m := [g for g in gpus if g.uuid.startswith(token)]):
            g = m[0]
        elif token.startswith("MIG-"):  # a MIG slice: NVML per-slice data is not read here
            g = GpuInfo(-1, f"MIG {token[:12]}", 0, 0)
        else:
            break
        out.append(VisibleGpu(len(out), token, g))
    return out


def busy_reason(info: GpuInfo, min_free_memory_gb: float) -> str | None:
    """Why a GPU is not free, or None when it is free."""
    if min_free_memory_gb <= 0:
        return None
    who = leases.holder(leases.gpu_key(info)) if info.index >= 0 else None
    if who is not None:  # another multigpu run took it, maybe before its CUDA context exists
        return f"leased by {who}"
    others = [p for p in info.processes if p[0] != os.getpid()]
    parts = []
    if others:
        pid, name, _ = others[0]
        more = f" +{len(others) - 1} more" if len(others) > 1 else ""
        parts.append(f"pid {pid} {name}{more}")
    low = info.memory_total and info.memory_total - info.memory_used < min_free_memory_gb * GIB
    if not (others or low):
        return None
    if info.memory_total:
        parts.append(f"{info.memory_used / GIB:.1f}/{info.memory_total / GIB:.1f} GB used")
    return ", ".join(parts)


def _states(vis: list[VisibleGpu], min_free: float) -> str:
    """Compact state of every visible GPU for an error message: '0 free, 1 busy (pid 7 python)'."""
    out = []
    for v in vis:
        why = busy_reason(v.info, min_free)
        out.append(f"{v.id} free" if why is None else f"{v.id} busy ({why})")
    return ", ".join(out)


def _cvd_note(cvd: str | None) -> str:
    return "" if cvd is None else f" (CUDA_VISIBLE_DEVICES={cvd!r} is set; ids count within it)"


# --------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class DevicePlan:
    accelerator: str  # "cuda" or "cpu"
    gpu_ids: tuple[int, ...]  # ids as this process sees them; () for cpu
    nproc: int  # processes to start on this node
    gpu_names: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()  # children's CUDA_VISIBLE_DEVICES entries, one per gpu id
    uuids: tuple[str, ...] = ()  # NVML's UUID of each gpu id ("" where unknown: a MIG slice)
    lease_keys: tuple[str, ...] = ()  # leases.py key of each gpu id; "" for a MIG slice (no lease)
    user_cvd: str | None = None  # the user's CUDA_VISIBLE_DEVICES when set
    note: str = ""  # why this plan, when not obvious ("no GPU found")

    def cuda_visible_devices(self) -> str | None:
        """The children's CUDA_VISIBLE_DEVICES: physical GPUs, "" (hide all) for cpu, None = keep."""
        if self.accelerator == "cpu":
            return ""
        return ",".join(self.tokens) if self.tokens else None

    def crowded(self) -> str | None:
        """Why CPU processes beyond this machine's cores are slow, with the fix; None otherwise."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if self.accelerator != "cpu" or self.nproc <= cores:
            return None
        return (f"{self.nproc} CPU processes on {cores} core{'s' if cores != 1 else ''}: they take "
                f"turns, each slower than one process alone; use --devices cpu:{cores} or fewer")

    def describe(self) -> str:
        if self.accelerator == "cpu":
            s = f"{self.nproc} CPU process{'es' if self.nproc != 1 else ''} (gloo)"
            return s + (f"; {self.note}" if self.note else "")
        n = len(self.gpu_ids)
        gpus = ", ".join(f"{i} ({name})" if name else str(i)
                         for i, name in zip(self.gpu_ids, self.gpu_names or [""] * n))
        s = f"{n} GPU{'s' if n != 1 else ''}: {gpus}"
        if self.user_cvd is not None:
            s += f" [CUDA_VISIBLE_DEVICES={self.user_cvd}: physical {','.join(self.tokens)}]"
        if self.nproc == 1 and n > 1:
            s += "; one process drives them all"
        return s


def _gpu_plan(chosen: list[VisibleGpu], one_process: bool, cvd: str | None) -> DevicePlan:
    return DevicePlan(
        accelerator="cuda",
        gpu_ids=tuple(v.id for v in chosen),
        nproc=1 if one_process else len(chosen),
        gpu_names=tuple(v.info.name for v in chosen),
        tokens=tuple(v.token for v in chosen),
        uuids=tuple(v.info.uuid for v in chosen),
        user_cvd=cvd,
        lease_keys=tuple(leases.gpu_key(v.info) if v.info.index >= 0 else "" for v in chosen),
    )


def lease(plan: DevicePlan, note: str, min_free_memory_gb: float) -> None:
    """Lease the plan's GPUs until this process exits, so that no other multigpu process (a sweep,
    another train) takes them; not when sharing on purpose (--min-free-memory 0)."""
    keys = {k: i for k, i in zip(plan.lease_keys, plan.gpu_ids) if k}
    if plan.accelerator != "cuda" or min_free_memory_gb <= 0 or not keys:
        return
    got = leases.try_lease(keys, note)
    if got is None:  # taken since resolve_devices looked
        who, gpu = next(((w, i) for k, i in keys.items() if (w := leases.holder(k))),
                        ("another run", plan.gpu_ids[0]))
        raise UsageError(f"GPU {gpu} was just taken by {who}; run again, or pick other GPUs "
                         "with --devices")
    leases.keep(got)


def parse_devices(spec: str) -> tuple[str, int | tuple[int, ...] | None]:
    """Grammar only: ("auto", None) | ("count", N) | ("ids", (0, 3)) | ("cpu", N)."""
    s = spec.strip().lower()
    if s == "auto":
        return "auto", None
    if m := re.fullmatch(r"cpu(?::(\d+))?", s):
        n = int(m.group(1) or 1)
        if n < 1:
            raise UsageError(f"--devices {spec}: a run needs at least one CPU process; "
                             "use --devices cpu:1")
        return "cpu", n
    if re.fullmatch(r"\d+", s):
        n = int(s)
        if n < 1:
            raise UsageError(f"--devices {spec} asks for zero GPUs; for GPU 0 alone write "
                             "--devices 0, (trailing comma), for the CPU --devices cpu:1")
        return "count", n
    if re.fullmatch(r"\d+(,\d+)*,?", s):
        ids = tuple(int(x) for x in s.rstrip(",").split(","))
        if len(set(ids)) != len(ids):
            raise UsageError(f"--devices {spec} names a GPU twice; name each GPU once, "
                             f"e.g. --devices {','.join(map(str, sorted(set(ids))))}")
        return "ids", ids
    raise UsageError(f"--devices {spec!r} is not understood{_torch_name_hint(s)}; use {GRAMMAR}")


def _torch_name_hint(s: str) -> str:
    """torch's own names for GPUs (cuda:7, cuda:0,1) are what a user of torch types first."""
    m = re.fullmatch(r"cuda:(\d+(?:,\d+)*),?", s)
    if m is None:
        return ""
    ids = m.group(1)
    several = "," in ids  # one id alone is written with a comma: `7` is a count of GPUs
    return (f" (GPUs are named by their index alone: write --devices {ids}{'' if several else ','} "
            f"for GPU{'s' if several else ''} {ids})")


def resolve_devices(spec: str, *, one_process: bool = False,
                    min_free_memory_gb: float = 2.0) -> DevicePlan:
    """Turn a `--devices` value into a DevicePlan; user mistakes raise UsageError (one line)."""
    if not 0 <= min_free_memory_gb < float("inf"):  # also nan
        raise UsageError(f"--min-free-memory {min_free_memory_gb:g} must be a number of GB, at least "
                         "0, e.g. --min-free-memory 2 (0 uses busy GPUs too)")
    kind, value = parse_devices(spec)
    if kind == "cpu":
        if one_process and value > 1:
            raise UsageError(f"--devices {spec}: this strategy runs one process, so it cannot use "
                             f"{value} CPU processes; use --devices cpu:1")
        return DevicePlan("cpu", (), 1 if one_process else value)

    cvd = user_cuda_visible()
    try:
        vis = visible_gpus(query_gpus(), cvd)
        why_none = "CUDA_VISIBLE_DEVICES hides every GPU" if cvd is not None else "NVML sees none"
    except NvmlUnavailable as exc:
        vis, why_none = [], f"no NVIDIA driver: {exc}"
    if not vis:
        if kind == "auto":
            return DevicePlan("cpu", (), 1, note=f"no GPU found ({why_none})")
        raise UsageError(f"--devices {spec}: this machine has no GPU ({why_none}); "
                         "use --devices cpu:N for N CPU processes")

    free = [v for v in vis if busy_reason(v.info, min_free_memory_gb) is None]
    states = _states(vis, min_free_memory_gb)
    if kind == "auto":
        if not free:
            raise UsageError(f"--devices auto: no GPU is free{_cvd_note(cvd)}: {states}; "
                             "wait, or share one on purpose with --devices ID, --min-free-memory 0")
        return _gpu_plan(free, one_process, cvd)

    if kind == "count":
        if value > len(vis):
            raise UsageError(f"--devices {value}: this machine has {len(vis)} GPU"
                             f"{'s' if len(vis) != 1 else ''}{_cvd_note(cvd)}; "
                             f"use --devices {len(vis)} or fewer")
        if value > len(free):
            hint = f"use --devices {len(free)}" if free else "wait for a GPU to be free"
            raise UsageError(f"--devices {value}: only {len(free)} of {len(vis)} GPUs are free"
                             f"{_cvd_note(cvd)}: {states}; {hint}, or name GPUs with "
                             "--devices 0,1 --min-free-memory 0 to share busy ones")
        return _gpu_plan(free[:value], one_process, cvd)

    return _named_plan(spec, value, vis, min_free_memory_gb, one_process, cvd)


def _named_plan(spec: str, ids: list[int], vis: list, min_free_memory_gb: float, one_process: bool,
                cvd) -> DevicePlan:
    """--devices 0,3: those GPUs, each there and free (or a one-line refusal saying which not)."""
    free = [v for v in vis if busy_reason(v.info, min_free_memory_gb) is None]
    states = _states(vis, min_free_memory_gb)
    by_id = {v.id: v for v in vis}
    for i in ids:
        if i not in by_id:
            have = ", ".join(str(v.id) for v in vis)
            raise UsageError(f"--devices {spec}: GPU {i} does not exist: this machine has "
                             f"{len(vis)} GPU{'s' if len(vis) != 1 else ''} ({have})"
                             f"{_cvd_note(cvd)}")
    busy = [i for i in ids if busy_reason(by_id[i].info, min_free_memory_gb) is not None]
    if busy:
        suggestion = [v.id for v in free][: len(ids)]
        listed = ",".join(map(str, suggestion)) + ("," if len(suggestion) == 1 else "")
        fix = f"use --devices {listed}" if suggestion else "wait for a GPU to be free"
        raise UsageError(f"--devices {spec}: GPU {', '.join(map(str, busy))} "
                         f"{'is' if len(busy) == 1 else 'are'} busy{_cvd_note(cvd)}: {states}; "
                         f"{fix}, or add --min-free-memory 0 to share it on purpose")
    return _gpu_plan([by_id[i] for i in ids], one_process, cvd)
