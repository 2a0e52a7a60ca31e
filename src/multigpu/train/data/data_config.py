"""What a run trains on and how it is loaded, as one checked value: the data spec (data_specs.py),
the batch per device, the shapes made, and the loader's workers and decoding."""
from __future__ import annotations

from dataclasses import dataclass

from multigpu.core.options import Flag, check_options, option
from multigpu.train.data.data_specs import check_spec

DECODE_CHOICES = ("auto", "cpu", "gpu")  # --decode (imagefolder.use_decode)
CPU_PLACEMENT_CHOICES = ("auto", "off")  # --cpu-placement (train/cpu_placing.py)


@dataclass(frozen=True)
class DataConfig:
    data: str = option("digits", "digits | synthetic:N | folder:PATH (train/ and val/ inside) | "
                                 "shards:DIR (train-*.tar, val-*.tar) | timeseries:CSV | "
                                 "timeseries:co2 | timeseries:macro (embedded)")
    batch_size: int | str = option(64, "samples per device per step (the global batch is this "
                                       "times the number of GPUs or processes; with "
                                       "--global-batch-size, the largest per device), or auto: the "
                                       "largest that fits on every GPU, found by real steps at "
                                       "the start", flag=Flag("N|auto"), at_least=1, example=64)
    image_size: int | None = option(None, "image side for synthetic and folder data (default: "
                                          "the model's own, e.g. 224 for resnet50)",
                                    at_least=1, example=224)
    seq_length: int = option(12, "timeseries: history length of each window", at_least=1)
    future_length: int = option(1, "timeseries: horizon predicted by each window", at_least=1)
    drop_last: bool = option(False, "drop the last partial step of each epoch instead of "
                                    "training on it")
    bad_images: str = option("skip", "folder: and shards: data, an image that cannot be decoded: skip (the "
                                     "next readable image takes its place, it is named and "
                                     "counted; the run stops if over 1 %% of an epoch's images "
                                     "are bad) or fail", choices=("skip", "fail"))
    decode: str = option("auto", "folder: and shards: data, where JPEGs are decoded: gpu (nvImageCodec on "
                                 "the GPU's JPEG engines where multigpu[nvimgcodec] is "
                                 "installed, else torchvision's nvJPEG; the crops on the GPU "
                                 "too, overlapped with the step), cpu (in the loader workers), "
                                 "auto (the workers, the GPU and a share of each are timed in "
                                 "turns in the first epoch and the fastest is kept; with "
                                 "--deterministic the workers alone when there are 15 or more "
                                 "per GPU, else the GPU)", choices=DECODE_CHOICES)
    workers: int | None = option(None, "DataLoader worker processes per rank (default: 0 for "
                                       "in-memory data, else the CPU cores per GPU)",
                                 at_least=0, example=4)
    cpu_placement: str = option("off", "GPU runs with loader workers: auto keeps one physical "
                                       "core (both hyperthreads) of each rank's share of the CPUs "
                                       "for the rank's main and autograd threads, which launch the "
                                       "GPU's kernels, and runs the loader workers on the share's "
                                       "other cores, one worker per CPU by default (the share: "
                                       "the cores of the GPU's NUMA node split among its ranks); "
                                       "off (the default) leaves them where the system puts "
                                       "them (docs/training.md)", choices=CPU_PLACEMENT_CHOICES)

    def __post_init__(self):
        check_options(self)
        check_spec(self.data)  # `--data ./imgs`: one line naming folder:./imgs, before any launch
