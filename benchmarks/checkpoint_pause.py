"""How long does saving a checkpoint hold training up? multigpu train's own Checkpointer, timed.

    python benchmarks/checkpoint_pause.py --model resnet50 --optimizer sgd --out DIR [--trials 5]

One process on one GPU (or the CPU): the model and optimizer of `multigpu train` (training.py),
a few bf16 steps on synthetic data so the optimizer has its state, then, in turns, trial by trial:
- `async`: Checkpointer.save as the epoch loop calls it (snapshot into pinned memory, write in the
  background): the pause is the time until training may go on;
- `sync`: the same save waiting for the write (fsync and manifest included), as a stop does;
- the step time while a background write runs, against steps with none;
- the background write alone, from the save to the checkpoint being complete.
One JSON object goes to DIR/checkpoint-pause.json and is printed.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from multigpu.train.checkpoints.checkpoint_store import CheckpointStore
from multigpu.train.settings.config import TrainConfig
from multigpu.train.engine import StepSettings, train_step
from multigpu.train.models.catalog import build_model, is_convnet
from multigpu.train.checkpoints.runstate import RunState
from multigpu.core.runtime import setup
from multigpu.train.checkpoints.checkpointer import Checkpointer
from multigpu.train.training import make_optimizer


class _Job:  # the parts of a training.Job that a Checkpointer reads
    def __init__(self, model, optimizer):
        self.model, self.optimizer, self.scheduler = model, optimizer, None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    rt = setup("single", "bf16" if cuda else "fp32")
    shape = (3, 224, 224) if is_convnet(args.model) else (32,)
    model = build_model(args.model, shape, 1000)
    settings = StepSettings(channels_last=cuda and is_convnet(args.model))
    if settings.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model = rt.prepare(model)
    optimizer = make_optimizer(TrainConfig.from_flat(model=args.model, optimizer=args.optimizer), model, rt.device)
    batch = (torch.randn(args.batch_size, *shape, device=rt.device),
             torch.randint(0, 1000, (args.batch_size,), device=rt.device))

    def step():
        train_step(rt, model, optimizer, torch.nn.functional.cross_entropy, batch, settings)

    def timed_steps(n):
        sync()
        began = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        return (time.perf_counter() - began) / n * 1e3

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(5):
        step()
    folder = Path(tempfile.mkdtemp(prefix="multigpu-pause-", dir=args.out))
    store = CheckpointStore(folder, keep=2)
    store.acquire()
    saver = Checkpointer(rt, _Job(model, optimizer), store, {"model": args.model})
    rows = {"async_pause_ms": [], "sync_pause_ms": [], "write_s": [], "step_ms_idle": [],
            "step_ms_writing": []}
    for trial in range(args.trials):
        rows["step_ms_idle"].append(timed_steps(10))
        for mode in ("async", "sync"):
            sync()
            began = time.perf_counter()
            saver.save(RunState(global_step=2 * trial + (mode == "sync")), metrics=None, best=False,
                       wait=mode == "sync")
            rows[f"{mode}_pause_ms"].append((time.perf_counter() - began) * 1e3)
            if mode == "async":  # steps while the write runs
                rows["step_ms_writing"].append(timed_steps(10))
                saver.finish()
        began = time.perf_counter()  # the background write alone, start to complete
        saver.save(RunState(global_step=10_000 + trial), metrics=None, best=False)
        saver.finish()
        rows["write_s"].append(time.perf_counter() - began)
    size = store.entries()[-1].size
    saver.close()
    store.release()
    report = {
        "model": args.model, "optimizer": args.optimizer, "checkpoint_mb": round(size / 1e6, 1),
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "trials": args.trials,
        "median": {k: round(statistics.median(v), 3) for k, v in rows.items()}, "all": rows,
    }
    Path(args.out, "checkpoint-pause.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["median"] | {"checkpoint_mb": report["checkpoint_mb"]}))


if __name__ == "__main__":
    # our GPU machines' rule (NVLink multicast off), read by NCCL when the process group starts;
    # multigpu itself does not set it
    for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                       "NVSHMEM_DISABLE_NVLS": "1"}.items():
        os.environ.setdefault(key, value)
    main()
