"""What a `multigpu train` run works out from its frozen config, its runtime and its data, made
once per rank as the job is built (training.build_job) and read from the job from then on: the
loaders' workers, the image side, the learning rate, the batch per device, the accumulation and
the global batch, the compile mode, where folder: JPEGs are decoded and the CPUs the rank's
threads and workers were placed on. Nothing after the job's
start works these out again; config.json keeps the plan as its `plan` block (training.resolved_config).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RunPlan:
    image_size: int | None  # the side images are made at (synthetic images, folder:); else --image-size
    workers: int            # DataLoader worker processes per rank
    lr: float               # the optimizer's: --lr as given or the optimizer's usual one (nothing is scaled)
    batch_size: int         # samples per device in a micro-batch (--global-batch-size: its choice)
    accumulate: int         # micro-batches per optimizer step (--global-batch-size: its choice)
    global_batch: int       # samples per step over all devices (--global-batch-size: per optimizer step)
    compile: str | None     # the mode the model is compiled in (--compile auto decided), None: not compiled
    decode: str | None      # folder: data, where JPEGs are decoded: cpu, gpu, or trial (--decode auto
    #                         times both in the first epoch); None for other data
    cpu_placement: dict | None = None  # --cpu-placement auto, applied: rank 0's CPU lists
    #                         (cpu_placement.Placement.record); None: not placed

    def record(self) -> dict:
        """config.json's `plan` block."""
        return asdict(self)


def decode_path(data) -> str | None:
    """Where the run's training images are decoded, as imagefolder.use_decode set it (None for
    data other than folder:)."""
    train = data.train
    if not hasattr(train, "measure_decode"):
        return None
    return "trial" if train.measure_decode else "gpu" if train.on_gpu else "cpu"
