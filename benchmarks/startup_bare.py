"""The floor under `multigpu train`'s start-up: a bare torchrun script, timed as startup_phases.py
times multigpu (command -> process group -> first optimizer step).

    BARE_STARTED_AT=$(python -c 'import time; print(time.time())') \
        torchrun --standalone --nproc-per-node 2 benchmarks/startup_bare.py [--model resnet50]

What every DDP script pays and multigpu cannot cut: torchrun's agent (its torch import, the
rendezvous), the workers' torch import, init_process_group, DDP's constructor (which imports
torch's compiler) and the first step. The model is torchvision's where it is installed (as in
pytorch/examples' ImageNet recipe), else multigpu's built-in of that name, in plain PyTorch.
Rank 0 prints one line: `bare: group at G s, first step done at F s since the command`.

    BARE_STARTED_AT=... python benchmarks/startup_bare.py --fork 2 [--model resnet50]

--plain: one process started by itself (no torchrun, no process group, no DDP): the floor of a
one-GPU script; its "group" figure is the CUDA context's. --plain --tuned: the same with what
`multigpu train`'s first step does besides on a GPU (cudnn.benchmark's autotuning, channels_last,
bf16 autocast).

--fork N: what workers forked from the agent would save. This process imports torch, runs
torchrun's agent in-process (as multigpu's launcher does) with this script's `worker` as a
function entrypoint and start_method "fork": the workers are copies of a process that has torch
imported, and import nothing again (the agent never touches CUDA, so a fork is safe for it).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

STARTED_ENV = "BARE_STARTED_AT"


def build(name: str, image_size: int):
    try:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10)
    except ImportError:  # (this machine has no torchvision) the same kind of network, ours
        from multigpu.train.models.catalog import build_model

        return build_model(name, (3, image_size, image_size), 10)


def forked(nproc: int, argv: list[str]) -> None:
    """torchrun's agent in this process, its workers forked from it (see the docstring)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # LaunchConfig asks torch.cuda.is_available() (for its default NUMA binding), which initialises
    # CUDA in this process unless the check goes through NVML; a worker forked from a process with
    # CUDA initialised cannot use CUDA (on CPU machines nothing is initialised, so it worked there).
    # The binding itself runs in each forked worker, which reads its GPU's properties there.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", run_id="bare-fork", max_restarts=0,
                          start_method="fork")
    elastic_launch(config, worker)(argv)


def worker(argv: list[str]) -> None:
    # torchrun sets OMP_NUM_THREADS=1 for the processes it starts; a fork has its OpenMP already
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main(argv)


def plain(a) -> None:
    """The one-process floor: torch, the model on GPU 0, one SGD step (what a plain script pays)."""
    started = float(os.environ.get(STARTED_ENV) or time.time())
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.zeros(1, device=device)  # the CUDA context
    group = time.time() - started
    model = build(a.model, a.image_size).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, device=device)
    y = torch.randint(0, 10, (a.batch_size,), device=device)
    if a.tuned:  # what multigpu train's first step does on a GPU besides
        torch.backends.cudnn.benchmark = True
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.tuned):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.time() - started
    print(f"bare: group at {group:.2f} s, first step done at {first:.2f} s since the command", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--fork", type=int, metavar="N", help="N workers forked from the agent")
    p.add_argument("--plain", action="store_true",
                   help="one process started by itself, no torchrun, process group or DDP")
    p.add_argument("--tuned", action="store_true",
                   help="with --plain: cudnn.benchmark, channels_last and bf16 autocast, as multigpu train")
    a = p.parse_args(argv)
    if a.plain:
        return plain(a)
    if a.fork:
        return forked(a.fork, ["--model", a.model, "--batch-size", str(a.batch_size),
                               "--image-size", str(a.image_size)])
    started = float(os.environ.get(STARTED_ENV) or time.time())
    cuda = torch.cuda.is_available()
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    dist.barrier()
    group = time.time() - started
    model = build(a.model, a.image_size).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(a.batch_size, 3, a.image_size, a.image_size, device=device)
    y = torch.randint(0, 10, (a.batch_size,), device=device)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    first = time.time() - started
    if dist.get_rank() == 0:
        print(f"bare: group at {group:.2f} s, first step done at {first:.2f} s since the command",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
