"""--cpu-placement: a GPU rank's main thread on a physical core of its own, its loader workers on
the other cores of its share of the CPUs (the plan: core/system/cpu_placement.py).

`place_main_thread` runs in the rank's main thread once its process group has formed and the
watchdog's threads have started, before the run folder, the data and the model: the threads
started before it (the head start's, the orphan watcher's, torch's and NCCL's of the process
group, the watchdog's) keep every CPU; those the main thread starts afterwards inherit its core:
autograd's (at the first backward), the loaders' pin-memory thread, the thread that finishes
batches on the GPU (folder: data decoded there), the progress bar's, and torch.compile's
subprocesses. The loaders' workers move to the workers' CPUs first thing (loader_workers.py).
Only on CUDA: a CPU rank computes on its own threads, and one core would starve it.
"""
from __future__ import annotations

import warnings

import torch

from multigpu.core import console
from multigpu.core.runtime import Runtime
from multigpu.core.system import cpu_placement
from multigpu.core.system.cpu_placement import Placement, Topology
from multigpu.train.settings.config import TrainConfig
from multigpu.train.training import loader_workers


def place_main_thread(cfg: TrainConfig, rt: Runtime, topology: Topology | None = None) -> Placement | None:
    """With --cpu-placement auto on a CUDA rank whose loaders have workers: pin the calling
    (main) thread to the plan's `main` CPUs, size torch's CPU thread pool to them, and say the
    placement once (rank 0). The plan, or None where nothing was placed. `topology`: the
    machine's, read here when not given."""
    if cfg.input.cpu_placement != "auto" or rt.device.type != "cuda":
        return None
    env = rt.env
    if topology is None:
        topology = cpu_placement.read_topology(_local_gpus(rt))
    if topology is None:
        return None
    plan = cpu_placement.plan_placement(topology.allowed, topology.siblings, topology.gpu_local,
                                        env.local_rank, env.local_world_size)
    workers = loader_workers(cfg, rt, plan) if plan is not None else 0
    if not workers:  # no workers to keep apart from
        return None
    cpu_placement.pin_this_thread(plan.main)
    torch.set_num_threads(len(plan.main))  # its CPU operators: as many threads as it has CPUs
    # torch's DataLoader checks its worker count against the calling thread's CPUs: the main
    # thread's core alone now, while the workers have theirs (for the process's life)
    warnings.filterwarnings("ignore", message=r"This DataLoader will create \d+ worker processes",
                            category=UserWarning)
    console.info(describe(plan, env.rank, workers, rt.device))
    return plan


def describe(plan: Placement, rank: int, workers: int, device: torch.device) -> str:
    """The line a placed run says: where its main thread and its workers run."""
    where = {"share": f"NUMA node of {device}", "main": f"main thread on the NUMA node of {device}",
             "unknown": f"{device}'s NUMA node unknown"}[plan.numa]
    return (f"cpu placement: rank {rank} main thread on cpus {cpu_placement.cpu_list(plan.main)}; "
            f"{workers} loader worker{'s' * (workers != 1)} on cpus {cpu_placement.cpu_list(plan.workers)} "
            f"({where})")


def _local_gpus(rt: Runtime) -> list[int] | None:
    """The CUDA device of each local rank, in local rank order: under a launcher, rank r's is
    cuda:r (distributed.init_distributed); one process, its own. None where the ranks' devices
    are not all visible here (each rank sees its own GPU alone)."""
    env = rt.env
    if env.local_world_size == 1:
        return [rt.device.index or 0]
    if rt.device.index != env.local_rank or torch.cuda.device_count() < env.local_world_size:
        return None
    return list(range(env.local_world_size))
