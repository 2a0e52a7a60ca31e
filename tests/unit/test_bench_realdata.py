"""`multigpu bench --data real` times the input pipeline in its steady state: a slow dataset
feeding fast steps comes out at the dataset's rate, not at the step's.

The loader fills its queue (workers x prefetch_factor batches) while the model is built and warmed
up; a trial timed from that full queue got its batches for free and reported the step's speed
(100 % of synthetic on 4 GPUs, where whole epochs waited for data 22-25 % of the time).
"""
import time

import torch
from torch.utils.data import DataLoader, Dataset

from multigpu.bench import measure, realdata
from multigpu.bench.spec import Task

SAMPLE_SECONDS = 0.005  # per sample in a loader worker
BATCH, WORKERS, PREFETCH = 8, 2, 8
STEP_SECONDS = 0.010  # per step: twice the data's pace
DATA_RATE = WORKERS / SAMPLE_SECONDS  # samples/s: 400
STEP_RATE = BATCH / STEP_SECONDS  # samples/s: 800


class SlowSamples(Dataset):
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        time.sleep(SAMPLE_SECONDS)
        return torch.zeros(4), 0


def test_a_slow_dataset_is_timed_at_its_own_rate_not_the_prefetch_burst():
    loader = DataLoader(SlowSamples(), batch_size=BATCH, num_workers=WORKERS,
                        prefetch_factor=PREFETCH, persistent_workers=True)
    steps = []

    def train_one(batch) -> int:
        # the first step stands for the build and warm-up (cuDNN autotuning, compiling): long
        # enough for the workers to fill their whole queue meanwhile
        time.sleep(0.5 if not steps else STEP_SECONDS)
        steps.append(len(batch[0]))
        return len(batch[0])

    prep = realdata.loader_prepared(loader, train_one, [torch.device("cpu")])
    assert prep.extra_warmup == WORKERS * PREFETCH + realdata.DEVICE_AHEAD
    task = Task(method="multigpu-ddp", model="mlp", batch_size=BATCH, gpus=1, image_size=8,
                precision="fp32", data="folder:x", num_outputs=10, warmup=1, steps=16, trials=1)
    run = measure.Run(task, prep, [torch.device("cpu")], None, 0.0, task.warmup + prep.extra_warmup)
    try:
        measure.warm_up(run)
        measure.time_trial(run)
    finally:
        prep.close()
    rate = run.samples[0] / run.seconds[0]
    print(f"{rate:.0f} samples/s; the data gives {DATA_RATE:.0f}, the step {STEP_RATE:.0f}")
    assert run.samples == [16 * BATCH]
    assert 0.5 * DATA_RATE < rate < 1.15 * DATA_RATE
