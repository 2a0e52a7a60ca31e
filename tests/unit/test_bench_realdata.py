"""`multigpu bench --data real` times the input pipeline in its steady state: a slow dataset
feeding fast steps comes out at the dataset's rate, not at the step's.

The loader fills its queue (workers x prefetch_factor batches) while the model is built and warmed
up; a trial timed from that full queue got its batches for free and reported the step's speed
(100 % of synthetic on 4 GPUs, where whole epochs waited for data 22-25 % of the time).
"""
import json
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


# --------------------------------------------------------------------------- generated folders

def _files(folder, split="train"):
    return sorted((folder / split).glob("class_*/*.jpg"))


def test_the_detailed_folder_has_imagenet_like_files_sizes_and_modes(tmp_path):
    """66 images: seeds 0 and 33 greyscale, 1 and 51 CMYK; ~100 KB files of mixed shapes."""
    from PIL import Image

    from multigpu.bench import imagegen
    from multigpu.train.data.datasets import load_data

    folder = realdata.ensure_image_folder(tmp_path, 66, 224, workers=1, kind="detailed")
    assert folder.name == "jpeg-detailed-66"
    files = _files(folder)
    assert len(files) == 66
    opened = {int(f.stem): Image.open(f) for f in files}
    modes = {seed: image.mode for seed, image in opened.items()}
    assert sorted(s for s, m in modes.items() if m == "L") == [0, 33]
    assert sorted(s for s, m in modes.items() if m == "CMYK") == [1, 51]
    shapes = [image.size for image in opened.values()]
    assert len(set(shapes)) >= 5 and any(w < h for w, h in shapes) and any(w > h for w, h in shapes)
    assert all(225 <= min(s) and max(s) <= 800 for s in shapes)
    mean_area = sum(w * h for w, h in shapes) / len(shapes)
    assert 0.75 < mean_area / (500 * 375) < 1.35
    rgb = [f.stat().st_size / 1000 for f in files if modes[int(f.stem)] == "RGB"]
    per_pixel = [f.stat().st_size / (opened[int(f.stem)].size[0] * opened[int(f.stem)].size[1])
                 for f in files if modes[int(f.stem)] == "RGB"]
    assert 80 < sum(rgb) / len(rgb) < 130  # KB
    assert 0.4 < min(per_pixel) and max(per_pixel) < 0.8  # bytes a pixel: ~100 KB at 500 x 375
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["kind"] == "detailed" and manifest["generated"].startswith("by multigpu.bench.imagegen")
    data = load_data(f"folder:{folder}", input_kind="image", image_size=32)  # every mode decodes
    assert [tuple(data.train[i][0].shape) for i in range(3)] == [(3, 32, 32)] * 3
    assert imagegen.make_image("detailed", 7).tobytes() == imagegen.make_image("detailed", 7).tobytes()


def test_the_smooth_folder_is_one_shape_and_small_files(tmp_path):
    from PIL import Image

    folder = realdata.ensure_image_folder(tmp_path, 20, 224, workers=1)
    assert folder.name == "jpeg-256px-20"
    files = _files(folder)
    assert {Image.open(f).size for f in files} == {(256, 256)}
    assert {Image.open(f).mode for f in files} == {"RGB"}
    assert json.loads((folder / "manifest.json").read_text())["kind"] == "smooth"
    assert realdata.ensure_image_folder(tmp_path, 20, 224, workers=1, kind="detailed") != folder


def test_bench_images_flag_picks_the_folder_kind():
    from multigpu.cli import build_parser
    from multigpu.cli.bench import settings_from_args

    parser = build_parser()
    args = parser.parse_args(["bench", "--data", "real", "--images", "detailed", "--devices", "cpu:1"])
    assert settings_from_args(args).images == "detailed"
    args = parser.parse_args(["bench", "--data", "real", "--devices", "cpu:1"])
    assert settings_from_args(args).images == "smooth"


def test_a_folder_past_its_distinct_images_links_the_rest_to_them(tmp_path, monkeypatch):
    """Image i past DISTINCT is image i % DISTINCT's file, in its own class folder: every file is
    read and decoded as a distinct one is; the manifest says how many differ."""
    from multigpu.bench import imagegen

    monkeypatch.setattr(imagegen, "DISTINCT", 4)
    folder = imagegen.write_folder(tmp_path / "f", "smooth", train=11, val=3, classes=3, shape=(40, 30), workers=1)
    files = {int(f.stem): f for f in _files(folder)}
    assert sorted(files) == list(range(11))
    assert [f.parent.name for _, f in sorted(files.items())] == [f"class_{i % 3:02d}" for i in range(11)]
    for i in range(4, 11):
        assert files[i].read_bytes() == files[i % 4].read_bytes()
    assert len({files[i].read_bytes() for i in range(4)}) == 4
    val = sorted(int(f.stem) for f in _files(folder, "val"))
    assert val == [11, 12, 13] and len({f.read_bytes() for f in _files(folder, "val")}) == 3
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["train_images"], manifest["distinct_train_images"]) == (11, 4)


def test_a_folder_written_again_over_its_links_is_made_again(tmp_path, monkeypatch):
    """benchmarks/decode_pipeline.py --make DIR twice: the second write meets the links of the
    first (os.link: file exists) and makes the same folder again."""
    from multigpu.bench import imagegen

    monkeypatch.setattr(imagegen, "DISTINCT", 4)
    for _ in range(2):
        folder = imagegen.write_folder(tmp_path / "f", "smooth", train=9, val=2, classes=3, shape=(40, 30), workers=1)
    files = {int(f.stem): f for f in _files(folder)}
    assert sorted(files) == list(range(9))
    assert all(files[i].read_bytes() == files[i % 4].read_bytes() for i in range(4, 9))
    assert all(files[i].stat().st_ino == files[i % 4].stat().st_ino for i in range(4, 9))
