"""`multigpu bench`: our training step against the hand-written and library recipes, side by side.

    multigpu bench --model resnet50 --batch-size 128 --precision bf16 --gpus 1,2,4
    multigpu bench --model resnet50 --batch-size 32,64,256 --methods multigpu-ddp,ddp --gpus 1,4
    multigpu bench --model resnet50 --data synthetic,real --methods multigpu-ddp --gpus 1,4
    multigpu bench --model resnet50 --compile --methods multigpu-single,multigpu-ddp --gpus 1,4
    multigpu bench --model mlp --devices cpu:2 --gpus 1,2 --steps 3 --image-size 8   # CPU smoke test

Methods (one training step each, same model object, same data, same seed):
    multigpu-single   multigpu.train.engine.train_step on one GPU (strategy single): the reference
    multigpu-dp       the same step, strategy dp (nn.DataParallel in one process)
    multigpu-ddp      the same step, strategy ddp (one process per GPU)
    multigpu-ddp:V    the same with one DDP setting changed (spec.DDP_VARIANTS), timed in turns
    multigpu-fsdp     the same step, strategy fsdp (FSDP2, sharded); not in the default methods
    ddp               the hand-written torchrun + DistributedDataParallel recipe
    accelerate        HF Accelerate, Accelerator(mixed_precision=...)
    fabric            Lightning Fabric, Fabric(strategy="ddp", precision="...-mixed")

How it runs (module by module):
    spec.py     flags -> BenchSettings -> Tasks grouped into launches (fewest process starts)
    runner.py   the parent: starts each group through multigpu.launcher.launch, collects, writes reports
    worker.py   inside each launched process: builds and warms up the tasks that differ only in
                the method, then times their trials in turns (drift hits them alike)
    peers.py    the three peer recipes
    stats.py    median / spread / scaling efficiency / MFU, FLOP counting
    report.py   rich table, JSON, PNG plot
    realdata.py a cached JPEG folder for --data real
    imagegen.py the generated JPEG folders: smooth and detailed (like ImageNet's files)
"""
from multigpu.bench.spec import METHODS, BenchSettings

__all__ = ["METHODS", "BenchSettings", "run_bench"]


def run_bench(settings: BenchSettings) -> dict:
    """Run every task of `settings`; returns the report dict also written to JSON (see report.py)."""
    from multigpu.bench.runner import run

    return run(settings)
