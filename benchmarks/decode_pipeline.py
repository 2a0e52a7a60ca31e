"""The folder: input pipeline alone, no model: images per second that reach one GPU, per decode mode.

    python benchmarks/decode_pipeline.py --make DIR [--kind smooth|detailed] [--train 12800]  # once
    python benchmarks/decode_pipeline.py --folder DIR --out FILE.json [--workers 15] [--batches 60]
    python benchmarks/decode_pipeline.py --decoders --folder DIR [--folder DIR2] --out FILE.json

--make writes a generated folder (multigpu.bench.imagegen): smooth 500 x 375 JPEGs, or detailed
ones like ImageNet's files (~100 KB, mixed sizes, a few greyscale and CMYK; CMYK files go to the
workers on every path). --decoders times each GPU JPEG decoder (jpeg_decoders: nvImageCodec
on the hardware engines, torchvision's nvJPEG) on batches of --batch files already in memory,
on a side stream as the prefetch thread runs them: decoding alone, and decoding with the crops
(gpu_images.decode_batch, the whole GPU path after the workers). The loader modes `gpu:NAME` pin
one decoder (nvimgcodec or torchvision) for the whole pipeline, `gpu:NAME@T` with T batches
finished at once (the finishing threads); `gpu` takes the one a run picks.

What `multigpu train --data folder:DIR` builds on one GPU (imagefolder + loaders.shard_loader and
its copy stream), iterated without a step: `cpu` (the workers decode), `gpu` (nvJPEG on the copy
stream), and `hybrid-S` (a share S of each batch decoded by the workers, the rest on the GPU).
Modes take turns, round by round; the median round is reported. The first batches of a round
(the workers' queue filling) are left out of the timing.
"""
import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from multigpu.bench import imagegen
from multigpu.train.data import gpu_images, imagefolder, jpeg_decoders
from multigpu.core.loading.loaders import shard_loader


def decoders(device) -> dict:
    """Every GPU JPEG decoder that passes its probe here, by the name --modes gpu:NAME uses."""
    made = {}
    for name, make in (("nvimgcodec", lambda: jpeg_decoders.NvImageCodecDecoder(device)),
                       ("torchvision", jpeg_decoders.TorchvisionDecoder)):
        try:
            decoder = make()
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {exc}")
            continue
        problem = jpeg_decoders.probe_problem(decoder, device)
        if problem:
            print(f"{name}: {problem}")
        else:
            made[name] = decoder
    return made


def compare_decoders(folder: str, device, batch: int, batches: int, rounds: int) -> dict:
    """Images/s of each decoder alone, and with the crops, on files read into memory."""
    train = imagefolder.load_folder(folder, 224).train
    train.on_gpu = True
    samples = [train[i][0] for i in range(min(len(train), batch * batches))]
    samples = [s for s in samples if isinstance(s, gpu_images.EncodedImage)]
    groups = [samples[i:i + batch] for i in range(0, len(samples) - batch + 1, batch)]
    files = [[s.data for s in group] for group in groups]
    built = [gpu_images.ImageBatch(group) for group in groups]  # as the workers hand them over
    made = decoders(device)
    side = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    result = {"folder": folder, "files": len(samples), "mean_kb": round(
        sum(s.data.numel() for s in samples) / len(samples) / 1024, 1), "alone": {}, "with_crops": {}}

    def timed(work) -> float:
        with side:
            work(0)  # warm-up: first allocations, the decoder's own start
            sync(device)
            start = time.perf_counter()
            for g in range(len(groups)):
                work(g)
            sync(device)
        return round(len(samples) / (time.perf_counter() - start), 1)

    for name, decoder in made.items():
        jpeg_decoders.use(device, decoder)
        alone = [timed(lambda g, decoder=decoder: decoder.decode(files[g], device)) for _ in range(rounds)]
        crops = [timed(lambda g: gpu_images.decode_batch(built[g], 224, device, None)) for _ in range(rounds)]
        result["alone"][name], result["with_crops"][name] = statistics.median(alone), statistics.median(crops)
        print(folder, name, "alone", alone, "with crops", crops, flush=True)
    return result


def pinned(mode: str, device):
    """gpu:NAME or gpu:NAME@THREADS: that decoder, a new one per mode, finishing THREADS batches at
    once (prefetch_thread; its own default otherwise)."""
    name, _, threads = mode.split(":")[1].partition("@")
    decoder = decoders(device)[name]
    if threads:
        decoder.threads = int(threads)
    return decoder


def loader_for(data, mode: str, workers: int, batch: int, device):
    train = data.train
    train.on_gpu = mode != "cpu"
    train.cpu_share = float(mode.split("-")[1]) if mode.startswith("hybrid-") else 0.0
    loader = DataLoader(train, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=train.collate,
                        persistent_workers=True, prefetch_factor=4)
    return shard_loader(loader, layout=(1, 0, 1), device=device, seed=0,
                        on_step=lambda info: None)


def time_round(prepared, batches: int, skip: int, pin=None) -> float:
    if pin is not None:  # gpu:NAME: this decoder in the prefetch thread
        jpeg_decoders.use(torch.device("cuda", 0), pin)
    if skip + batches > len(prepared):
        raise SystemExit(f"--batches {batches}: one epoch has {len(prepared)} batches, {skip} of them "
                         f"left untimed: make a larger folder (--make --train) or time fewer batches")
    it = iter(prepared)
    for _ in range(skip):
        next(it)
    torch.cuda.synchronize()
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        x, _ = next(it)
        images += x.shape[0]
    torch.cuda.synchronize()
    return images / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--make")
    p.add_argument("--train", type=int, default=12800)
    p.add_argument("--folder", action="append")
    p.add_argument("--kind", choices=imagegen.KINDS, default="smooth")
    p.add_argument("--decoders", action="store_true")
    p.add_argument("--device", default="cuda:0", help="--decoders on cpu: a smoke test of this script")
    p.add_argument("--out")
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="cpu,gpu,hybrid-0.47")
    a = p.parse_args()
    if a.make:
        start = time.perf_counter()
        imagegen.write_folder(Path(a.make), a.kind, a.train, 256)
        print(f"{a.train} {a.kind} images in {a.make}: {time.perf_counter() - start:.0f} s")
        return
    device = torch.device(a.device)
    if a.decoders:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none"
        result = {"what": "images/s of each GPU JPEG decoder, files in memory, no loader, no model",
                  "batch": a.batch, "size": 224, "torch": torch.__version__, "gpu": gpu,
                  "host_threads": jpeg_decoders.HOST_THREADS,
                  "folders": [compare_decoders(f, device, a.batch, a.batches, a.rounds) for f in a.folder]}
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        return
    folder = a.folder[0]
    data = imagefolder.load_folder(folder, 224)
    modes = a.modes.split(",")
    pins = {m: pinned(m, device) for m in modes if m.startswith("gpu:")}
    loaders = {m: loader_for(imagefolder.load_folder(folder, 224), m.split(":")[0], a.workers, a.batch, device)
               for m in modes}
    rounds = {m: [] for m in modes}
    skip = max(2, a.workers)  # a round starts a new epoch: let the queue fill first
    for _ in range(a.rounds):
        for m in modes:
            rounds[m].append(round(time_round(loaders[m], a.batches, skip, pins.get(m)), 1))
            print(m, rounds[m][-1], flush=True)
    result = {"what": "images/s reaching one GPU from the folder: pipeline, no model",
              "images": len(data.train), "shape": "500x375 JPEG q90", "size": 224, "batch": a.batch,
              "workers": a.workers, "batches_timed": a.batches, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name(0), "cpus": len(__import__("os").sched_getaffinity(0)),
              "python": platform.python_version(),
              "median": {m: statistics.median(v) for m, v in rounds.items()}, "rounds": rounds}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"]))


if __name__ == "__main__":
    main()
