"""Where a loader worker's time goes on `folder:` data decoded by the CPUs (`--decode cpu`).

    PYTHONPATH=src python benchmarks/cpu_pipeline.py --out FILE.json [--images 384] [--batch 32]
        [--workers 1,2] [--data DIR] [--rounds 3]

Both generated folders (multigpu.bench.imagegen: smooth 500 x 375, and detailed, like ImageNet's
files) are made under --data (default /tmp/multigpu-cpu-pipeline, kept for the next run), then:
1. per sample, on one thread as in a worker: read the file, decode, crop + resize, flip, to a
   uint8 tensor, the label's tensor; with the decoder `multigpu train` uses (torchvision where it
   imports, else PIL), milliseconds (medians of --rounds passes);
2. per batch: the collate (stack of images, of labels), and its way to the main process (pickling
   it for the queue, which copies the images into shared memory unless they are there already),
   the pin_memory copy (on CUDA only);
3. whole loaders, as `multigpu train` builds them (imagefolder + loaders.shard_loader on cuda:0
   where there is one, else the CPU), with 1 and 2 workers: images/s, the share of each worker's
   time in the dataset and the collate (timed inside the workers), and the main process's time
   per batch outside its wait for the next one; and the same loaders over a dataset that hands
   out a ready-made sample (`null`): the ceiling set by everything but decoding.
One JSON object goes to --out and a table is printed. Set OMP_NUM_THREADS=1 to match workers.
"""
import argparse
import io
import json
import os
import pickle
import platform
import statistics
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing  # noqa: F401  (registers tensors' reductions: by shared memory)
from torch.utils.data import DataLoader, Dataset

from multigpu.bench import imagegen
from multigpu.core.loading.loaders import PerSampleSeed, shard_loader
from multigpu.train.data import imagefolder

SIZE = 224


def make_folders(base: Path, images: int, kinds=imagegen.KINDS) -> dict[str, Path]:
    folders = {}
    for kind in kinds:
        folder = base / f"{kind}-{images}"
        if not (folder / "manifest.json").exists():
            imagegen.write_folder(folder, kind, images, 20)
        folders[kind] = folder
    return folders


def sample_stages(dataset, index: int, decoder: str) -> dict[str, float]:
    """Seconds of each stage of dataset._read for sample `index`, done by hand in the same order."""
    path, label = dataset.samples[index]
    t = [time.perf_counter()]
    PerSampleSeed(dataset, 0)._seed(0, index)  # what a worker does before each sample
    t.append(time.perf_counter())
    data = Path(path).read_bytes()
    t.append(time.perf_counter())
    if decoder == "torchvision":
        from torchvision.io import ImageReadMode, decode_image
        from torchvision.transforms.v2 import functional as TF

        image = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        t.append(time.perf_counter())
        (left, top, w, h), flip, _ = dataset._crop(image.shape[2], image.shape[1])
        image = TF.resized_crop(image, top, left, h, w, [SIZE] * 2, antialias=True)
        t.append(time.perf_counter())
        image = image.flip(-1) if flip else image
        t.append(time.perf_counter())
        image = image.contiguous()
    else:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as raw:
            image = raw.convert("RGB")
        t.append(time.perf_counter())
        box, flip, _ = dataset._crop(*image.size)
        image = imagefolder._resize_box(image, box, False, SIZE)
        t.append(time.perf_counter())
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image
        t.append(time.perf_counter())
        image = imagefolder._to_tensor(image)
    t.append(time.perf_counter())
    torch.tensor(label, dtype=torch.int64)
    t.append(time.perf_counter())
    names = ("seed", "read", "decode", "crop_resize", "flip", "to_tensor", "label")
    return {n: t[i + 1] - t[i] for i, n in enumerate(names)}


def per_sample(folder: Path, rounds: int) -> dict:
    dataset = imagefolder.load_folder(str(folder), SIZE).train
    decoder = dataset.decoder
    passes = []
    for r in range(rounds):
        torch.manual_seed(r)
        stages = [sample_stages(dataset, i, decoder) for i in range(len(dataset))]
        passes.append({k: sum(s[k] for s in stages) / len(stages) for k in stages[0]})
        seeded = PerSampleSeed(dataset, r)
        began = time.perf_counter()
        for i in range(len(dataset)):
            seeded[0, i]
        passes[-1]["shipped_getitem"] = (time.perf_counter() - began) / len(dataset)
    ms = {k: round(1000 * statistics.median(p[k] for p in passes), 3) for k in passes[0]}
    ms["stages_total"] = round(sum(v for k, v in ms.items() if k != "shipped_getitem"), 3)
    return {"decoder": decoder, "ms": ms, "alone_images_per_s": round(1000 / ms["shipped_getitem"], 1)}


def per_batch(folder: Path, batch: int, rounds: int) -> dict:
    dataset = imagefolder.load_folder(str(folder), SIZE).train
    samples = [dataset[i % len(dataset)] for i in range(batch)]
    collate = dataset.collate
    times: dict[str, list[float]] = {"collate": [], "send_pickle": [], "pin_memory": []}
    for _ in range(rounds):
        began = time.perf_counter()
        images, labels = collate(samples)
        times["collate"].append(time.perf_counter() - began)
        began = time.perf_counter()
        ForkingPickler.dumps((images, labels), pickle.HIGHEST_PROTOCOL)
        times["send_pickle"].append(time.perf_counter() - began)
        if torch.cuda.is_available():
            began = time.perf_counter()
            images.pin_memory()
            times["pin_memory"].append(time.perf_counter() - began)
        del images, labels
    return {k: round(1000 * statistics.median(v), 3) for k, v in times.items() if v}


class Timed(Dataset):
    """The dataset, with the CPU seconds its thread spent in __getitem__ and in the collate
    counted per worker (shared memory: the workers' counts reach the main process). CPU time, not
    wall time: on a busy machine a worker waits for a core inside them too."""

    def __init__(self, dataset, slots: int = 64):
        self.dataset, self.collate_fn = dataset, dataset.collate
        self.on_device = getattr(dataset, "on_device", None)
        self.seconds = torch.zeros(slots, 2, dtype=torch.float64).share_memory_()

    def __len__(self):
        return len(self.dataset)

    def _slot(self) -> int:
        info = torch.utils.data.get_worker_info()
        return info.id + 1 if info else 0

    def __getitem__(self, index):
        began = time.thread_time()
        item = self.dataset[index]
        self.seconds[self._slot(), 0] += time.thread_time() - began
        return item

    def collate(self, samples):
        began = time.thread_time()
        out = self.collate_fn(samples)
        self.seconds[self._slot(), 1] += time.thread_time() - began
        return out


class Null(Dataset):
    """Ready-made samples: what loading costs besides making them."""

    def __init__(self, like, count: int):
        self.sample, self.count, self.collate = like, count, imagefolder.ImageFolderDataset.collate

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return self.sample[0].clone(), torch.tensor(0, dtype=torch.int64)


def whole_loader(dataset, workers: int, batch: int, epochs: int, device) -> dict:
    """`epochs` epochs through shard_loader as `multigpu train` builds it, the last one timed
    whole (earlier ones warm up; between epochs the workers are idle, so their counts are that
    epoch's). The seeding of each sample (loaders.PerSampleSeed) is outside `getitem`. CPU
    seconds: of the workers (from /proc) and of the main process (its threads: the training
    thread, the pin_memory thread), per batch."""
    timed = Timed(dataset)
    loader = DataLoader(timed, batch_size=batch, shuffle=True, num_workers=workers,
                        collate_fn=timed.collate, persistent_workers=True, prefetch_factor=4)
    prepared = shard_loader(loader, layout=(1, 0, 1), device=device, seed=0,
                            on_step=lambda info: None)
    images = batches = 0
    for epoch in range(epochs):
        if epoch == epochs - 1:
            pids = [w.pid for w in prepared.loader._iterator._workers]
            timed.seconds.zero_()
            cpu = (_cpu_seconds(pids), time.process_time())
            began, images, batches = time.perf_counter(), 0, 0
        for x, _ in _synced(iter(prepared), device):
            images, batches = images + x.shape[0], batches + 1
    wall = time.perf_counter() - began
    worker_cpu, main_cpu = _cpu_seconds(pids) - cpu[0], time.process_time() - cpu[1]
    getitem_s, collate_s = timed.seconds.sum(0).tolist()
    del prepared, loader
    per_batch = lambda seconds: round(1000 * seconds / batches, 2)  # noqa: E731
    return {"images_per_s": round(images / wall, 1),
            "per_worker_images_per_s": round(images / wall / workers, 1),
            "ms_per_batch": per_batch(wall),
            # the workers' CPU time per batch: in the dataset, in the collate, in the rest
            # (seeding, sending the batch, the worker loop); and their time off a CPU (waiting
            # for work, or for a core on a busy machine)
            "workers_ms_per_batch": {"getitem": per_batch(getitem_s), "collate": per_batch(collate_s),
                                     "rest_of_cpu": per_batch(worker_cpu - getitem_s - collate_s),
                                     "off_cpu": per_batch(wall * workers - worker_cpu)},
            "main_cpu_ms_per_batch": per_batch(main_cpu)}


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of processes `pids` so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def _synced(it, device):
    for x, y in it:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        yield x, y


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--data", default="/tmp/multigpu-cpu-pipeline")
    p.add_argument("--images", type=int, default=384)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kinds", default=",".join(imagegen.KINDS), help="folders to make and time")
    a = p.parse_args()
    torch.set_num_threads(1)  # as in a DataLoader worker
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    folders = make_folders(Path(a.data), a.images, a.kinds.split(","))
    result = {"what": "where a loader worker's time goes, folder: data decoded by the CPUs",
              "images": a.images, "batch": a.batch, "size": SIZE, "device": str(device),
              "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
              "python": platform.python_version(), "folders": {}}
    for kind, folder in folders.items():
        out = result["folders"][kind] = {"per_sample": per_sample(folder, a.rounds),
                                         "per_batch_ms": per_batch(folder, a.batch, a.rounds)}
        dataset = imagefolder.load_folder(str(folder), SIZE).train
        for workers in map(int, a.workers.split(",")):
            out[f"loader_{workers}w"] = whole_loader(dataset, workers, a.batch, a.epochs, device)
            out[f"null_{workers}w"] = whole_loader(Null(dataset[0], len(dataset)), workers, a.batch,
                                                   a.epochs, device)
        print(kind, json.dumps(out, indent=1), flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
