"""Where a GPU rank's threads and its DataLoader workers run: a plan of CPU sets, and reading the
machine's topology to make it.

A rank that feeds a GPU launches its kernels from two threads: its main thread (the forward, the
optimizer) and torch's autograd thread (the backward), which the main thread starts at the first
backward. Beside busy loader workers on the hyperthread siblings of their cores they launch more
slowly, though they get their share of CPU time: a vCPU runs slower while its sibling works. The
plan keeps one whole physical core (both siblings; two cores where cores have one thread each)
for those threads and puts the workers on the other cores of the rank's share.

The share: the physical cores local to the rank's GPU (its NUMA node) split evenly, in whole
cores, among the node's local ranks whose GPUs are local to that node, in core order (the first
ranks get one more where they do not divide evenly). Where a GPU's node is not known (NVML
unavailable, a GPU not visible), all the allowed cores are split among the local ranks, in local
rank order; with one local rank, its share is every allowed core and its main thread goes on the
GPU's node where that is known. No plan where the workers would have fewer than two physical
cores, or where the system cannot pin threads (macOS).

`plan_placement` is a function of plain values, the same on every rank; `read_topology` reads them.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

CPU_ROOT = Path("/sys/devices/system/cpu")
MIN_WORKER_CORES = 2  # fewer physical cores for the workers: nothing to gain by keeping one apart


@dataclass(frozen=True)
class Topology:
    """What the plan is made from: the CPUs this process may use, the hyperthread sibling groups
    of the machine's CPUs, and for each local rank the CPUs local to its GPU (None: unknown)."""
    allowed: frozenset[int]
    siblings: tuple[frozenset[int], ...]
    gpu_local: tuple[frozenset[int] | None, ...] | None = None


@dataclass(frozen=True)
class Placement:
    """One rank's CPU sets: `main` for its main thread and the threads it starts (autograd's),
    `workers` for its loader workers. `numa`: "share" (the share is the GPU's NUMA node's cores),
    "main" (one rank on all the allowed cores, its main thread on the GPU's node) or "unknown"."""
    main: tuple[int, ...]
    workers: tuple[int, ...]
    numa: str

    def record(self) -> dict:
        """config.json's plan block: the CPU lists as `lscpu` writes them."""
        return {"main": cpu_list(self.main), "workers": cpu_list(self.workers), "numa": self.numa}


def plan_placement(allowed: Iterable[int], siblings: Iterable[Iterable[int]],
                   gpu_local: Sequence[Iterable[int] | None] | None, local_rank: int,
                   local_world_size: int) -> Placement | None:
    """The CPU sets of local rank `local_rank` of `local_world_size` (see the module's docstring).
    `siblings`: groups of CPUs that share a physical core (a CPU in none is a core of its own);
    `gpu_local`: per local rank, the CPUs local to its GPU, or None where not known."""
    cores = physical_cores(allowed, siblings)
    pool, index, members, numa = _pool(cores, gpu_local, local_rank, local_world_size)
    base, extra = divmod(len(pool), members)
    start = index * base + min(index, extra)
    share = pool[start:start + base + (index < extra)]
    local = None if gpu_local is None or numa == "unknown" else frozenset(gpu_local[local_rank])
    first = [c for c in share if local is not None and set(c) <= local] + \
        [c for c in share if local is None or not set(c) <= local]
    main: list[tuple[int, ...]] = []
    while first and sum(map(len, main)) < 2:
        main.append(first.pop(0))
    if sum(map(len, main)) < 2 or len(first) < MIN_WORKER_CORES:
        return None
    return Placement(tuple(sorted(c for core in main for c in core)),
                     tuple(sorted(c for core in first for c in core)), numa)


def physical_cores(allowed: Iterable[int], siblings: Iterable[Iterable[int]]) -> list[tuple[int, ...]]:
    """The allowed CPUs grouped by physical core, each core's CPUs sorted, cores in order of
    their first CPU."""
    group_of: dict[int, frozenset[int]] = {}
    for group in siblings:
        members = frozenset(group)
        group_of.update((cpu, members) for cpu in members)
    cores: dict[frozenset[int], list[int]] = {}
    for cpu in sorted(set(allowed)):
        cores.setdefault(group_of.get(cpu, frozenset({cpu})), []).append(cpu)
    return sorted((tuple(c) for c in cores.values()), key=lambda core: core[0])


def _pool(cores: list[tuple[int, ...]], gpu_local, local_rank: int,
          local_world_size: int) -> tuple[list[tuple[int, ...]], int, int, str]:
    """(the cores shared out, this rank's place among those sharing them, how many share them,
    Placement.numa)."""
    known = (gpu_local is not None and len(gpu_local) == local_world_size
             and all(g is not None for g in gpu_local))
    if not known:
        return cores, local_rank, local_world_size, "unknown"
    pools = [tuple(c for c in cores if set(c) <= set(g)) for g in gpu_local]
    mine = pools[local_rank]
    if local_world_size == 1:
        return cores, 0, 1, "share" if len(mine) == len(cores) else "main" if mine else "unknown"
    tangled = any(p != q and set(p) & set(q) for p in pools for q in pools)  # nodes that overlap
    if tangled or not all(pools):
        return cores, local_rank, local_world_size, "unknown"
    members = [r for r in range(local_world_size) if pools[r] == mine]
    return list(mine), members.index(local_rank), len(members), "share"


# --------------------------------------------------------------------------- reading the machine

def read_topology(gpus: Sequence[int] | None = None, root: Path = CPU_ROOT) -> Topology | None:
    """This process's allowed CPUs and the machine's sibling groups; with `gpus` (the CUDA device
    of each local rank, in local rank order), the CPUs local to each. None where threads cannot
    be pinned."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = frozenset(os.sched_getaffinity(0))
    local = gpu_local_cpus(gpus) if gpus is not None else None
    return Topology(allowed, read_siblings(allowed, root), local)


def read_siblings(cpus: Iterable[int], root: Path = CPU_ROOT) -> tuple[frozenset[int], ...]:
    """The hyperthread sibling group of each of `cpus`, as the kernel lists them
    (cpuN/topology/thread_siblings_list); a CPU whose list cannot be read is alone."""
    groups, unread = set(), set()
    for cpu in cpus:
        try:
            text = (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            groups.add(frozenset(parse_cpu_list(text)))
        except (OSError, ValueError):
            unread.add(cpu)
    listed = set().union(*groups)
    groups.update(frozenset({cpu}) for cpu in unread - listed)  # a sibling's list may name it
    return tuple(sorted(groups, key=min))


def gpu_local_cpus(gpus: Sequence[int]) -> tuple[frozenset[int] | None, ...] | None:
    """The CPUs of each CUDA device's NUMA node, as NVML reports them (found by the device's
    UUID, whatever CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER say); None for a device NVML does
    not answer for, and None in all where NVML is unavailable."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: the node is not known
        return None
    try:
        return tuple(_nvml_local(pynvml, str(torch.cuda.get_device_properties(g).uuid)) for g in gpus)
    except Exception:  # noqa: BLE001 - a device torch cannot describe: not known either
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_local(nv, uuid: str) -> frozenset[int] | None:
    token = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    words = (os.cpu_count() or 1) // 64 + 1
    try:
        mask = nv.nvmlDeviceGetCpuAffinity(nv.nvmlDeviceGetHandleByUUID(token), words)
    except nv.NVMLError:
        return None
    cpus = frozenset(64 * w + bit for w, word in enumerate(mask) for bit in range(64) if int(word) >> bit & 1)
    return cpus or None


def pin_this_thread(cpus: Iterable[int]) -> None:
    """Run the calling thread (on Linux, only it) on `cpus`; the threads and processes it starts
    from now on inherit them."""
    os.sched_setaffinity(0, set(cpus))


def parse_cpu_list(text: str) -> list[int]:
    """A kernel CPU list ("0-3,8,10-11") as its CPUs."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def cpu_list(cpus: Iterable[int]) -> str:
    """CPUs written as the kernel lists them: runs of three or more as ranges ("1-7,9-15"),
    pairs as two ("0,8")."""
    ordered = sorted(set(cpus))
    runs: list[list[int]] = []
    for cpu in ordered:
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)
