"""The GPU decode path's finishing helpers under a training step's load, in variants that take turns.

    PYTHONPATH=src python benchmarks/finish_under_load.py --out FILE.json [--rounds 3] [--steps 60]

A ResNet-50 training step (bf16, channels_last, SGD, batch 128) runs in the main thread, eager or
replayed as one CUDA graph, each step's input copied from the next finished batch; the batches
(ImageBatch, still encoded, as loader workers hand them over, from a generated folder of detailed
JPEGs in memory: no workers, no files) are decoded and cropped by prefetch_thread.finish_in_thread,
as `multigpu train --decode gpu` runs them. Variants: THREADS/PRIORITY, helpers on streams of
PRIORITY (0 or -1, higher); THREADS/PRIORITY/r, the same with nvImageCodec decoding into the
previous batch's Images (ReusingDecoder: no allocation per image); THREADS/PRIORITY/n, the decode
alone (the step not run); THREADS/PRIORITY/h, the step on a stream of the highest priority (the
decoder library's own streams and the helpers' below it); flags combine (2/0/r/h); and `synthetic` (the same step
on a fixed batch, nothing decoded). Per mode (eager,
graph) the variants take turns, round by round; images a second of each, the median round.

--profile VARIANTS: after the rounds, each (20 steps) once more per mode under torch.profiler, whose
CUPTI tracing records every CUDA runtime and driver call of the process (the decoder library's
threads' too): the calls that held a thread longest are printed and written beside --out
(what a device-wide wait inside the decode would show as: cudaFree, cudaDeviceSynchronize,
cudaStreamSynchronize, cudaMalloc on the legacy stream).
"""
import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from gpu_path_contention import resnet50_parts  # benchmarks/, the script's own folder on sys.path
from multigpu.bench import imagegen
from multigpu.core.loading.data import move_to_device
from multigpu.core.loading.prefetch_thread import finish_in_thread
from multigpu.train.data import gpu_images, imagefolder, jpeg_decoders


def training_step(dev, graph: bool, batch: int = 128):
    """(static input, step()): step trains on what the input holds; replayed as one graph if asked."""
    x, step = resnet50_parts(dev, batch, keep_grads=True)
    warm = torch.cuda.Stream(dev)
    warm.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(warm):
        for _ in range(5):
            step()
    torch.cuda.current_stream(dev).wait_stream(warm)
    if not graph:
        return x, step
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        step()
    return x, captured.replay


def batches_of(folder: str, count: int):
    """(the training dataset, `count` batches of 128 as its workers would hand them over)."""
    train = imagefolder.load_folder(folder, 224).train
    train.on_gpu = True
    samples = [train[i] for i in range(count * 128)]
    return train, [gpu_images.collate(samples[k:k + 128]) for k in range(0, len(samples), 128)]


class ReusingDecoder(jpeg_decoders.NvImageCodecDecoder):
    """nvImageCodec decoding into the Images of the thread's previous batch (its `images=`: their
    buffers resized, not allocated and freed per image), read through __cuda_array_interface__
    (a DLPack capsule is taken once). Safe here because a thread always decodes on its own stream,
    after the crops that read its previous batch were queued on it."""

    def __init__(self, device):
        super().__init__(device)
        self._kept = threading.local()

    def decode(self, encoded, device):
        sources = [self._code_stream(data) for data in encoded]
        readable = [k for k, src in enumerate(sources) if src is not None]
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        kept = getattr(self._kept, "images", [])
        reuse = {"images": kept[:len(readable)]} if len(kept) >= len(readable) else {}
        with self._decoder() as decoder:
            decoded = decoder.decode([sources[k] for k in readable], params=self._params, cuda_stream=stream,
                                     **reuse)
        if not reuse and all(image is not None for image in decoded):
            self._kept.images = list(decoded)
        images = [None] * len(encoded)
        for k, image in zip(readable, decoded, strict=True):
            if image is not None:
                images[k] = (torch.as_tensor(image, device=device) if device.type == "cuda"
                             else torch.from_numpy(np.array(image)))
        return images


def _no_step() -> None:
    pass


CHOSEN = REUSING = None  # set in main: the run's decoder, and the reusing one (variants ".../r")


def run(x, step, batches, dev, steps: int, variant: str, finish) -> float:
    if variant == "synthetic":
        source = ((k, None) for k in range(steps + 10))
    else:
        threads, priority, *flags = variant.split("/")
        threads, priority = int(threads), int(priority)
        jpeg_decoders.use(dev, REUSING if "r" in flags else CHOSEN)
        if "n" in flags:  # the decode alone: the step's input is still copied, the step not run
            step = _no_step
        pairs = ((k, batches[k % len(batches)]) for k in range(steps + 10))
        source = finish_in_thread(pairs, dev, lambda b: finish(move_to_device(b, dev, True), dev),
                                  threads=threads, priority=priority)
        if "h" in flags:  # the step (and its input's copy) on a stream of the highest priority
            with torch.cuda.stream(torch.cuda.Stream(dev, priority=-3)):
                print("step's stream priority", torch.cuda.current_stream(dev).priority, flush=True)
                return _timed(source, x, step, dev, steps)
    return _timed(source, x, step, dev, steps)


def _timed(source, x, step, dev, steps: int) -> float:
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    for k, batch in source:
        if k == 10:  # the helpers' queue filled, the step settled
            torch.cuda.synchronize(dev)
            began = time.perf_counter()
        if batch is not None:
            x.copy_(batch[0].float().sub_(mean))
        step()
    torch.cuda.synchronize(dev)
    return steps * 128 / (time.perf_counter() - began)


def profiled(work, trace: Path, top: int = 15) -> dict:
    """work() under torch.profiler: the CUDA runtime/driver calls (names starting with cu) that
    took the most host time, summed over the process's threads, and the trace's summary
    (trace_summary); the trace itself to `trace`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rate = work()
    prof.export_chrome_trace(str(trace))
    calls = [e for e in prof.key_averages() if e.key.startswith("cu")]
    calls.sort(key=lambda e: -e.cpu_time_total)
    rows = [{"call": e.key, "count": e.count, "host_ms": round(e.cpu_time_total / 1000, 1)} for e in calls[:top]]
    print(f"profiled at {rate:.0f} img/s; CUDA calls by host time:", flush=True)
    for row in rows:
        print(f"  {row['call']:40s} {row['count']:7d} calls {row['host_ms']:9.1f} ms", flush=True)
    summary = trace_summary(json.loads(trace.read_text()), top)
    print(json.dumps(summary, indent=1), flush=True)
    return {"rate": round(rate, 1), "calls": rows, "trace": summary}


def _union_ms(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1000


def trace_summary(trace: dict, top: int = 15) -> dict:
    """Where the GPU's time went in a chrome trace: the span of its kernels, the union of their
    time (the GPU busy with anything), each stream's kernel time and its top kernels, and the
    runtime/driver calls that held each host thread longest. A GPU busy for the whole span while
    decoding halves the rate says the decode's kernels take the step's SMs; a GPU idle while a
    thread waits in a call says that call is the wait."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {"kernels": 0}
    first = min(e["ts"] for e in kernels)
    last = max(e["ts"] + e["dur"] for e in kernels)
    streams: dict = {}
    for e in kernels:
        streams.setdefault(str(e.get("args", {}).get("stream", "?")), []).append(e)
    per_stream = {}
    for sid, evs in sorted(streams.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        names: dict = {}
        for e in evs:
            names[e["name"][:80]] = names.get(e["name"][:80], 0.0) + e["dur"]
        busiest = sorted(names.items(), key=lambda kv: -kv[1])[:6]
        busy = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in evs])
        per_stream[sid] = {"kernels": len(evs), "busy_ms": round(busy, 1),
                           "top": [[n, round(d / 1000, 1)] for n, d in busiest]}
    host: dict = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            key = (str(e.get("tid")), e["name"])
            host[key] = host.get(key, 0.0) + e["dur"]
    waits = sorted(host.items(), key=lambda kv: -kv[1])[:top]
    return {"span_ms": round((last - first) / 1000, 1),
            "gpu_busy_ms": round(_union_ms([(e["ts"], e["ts"] + e["dur"]) for e in kernels]), 1),
            "streams": per_stream,
            "host_calls": [[tid, name, round(d / 1000, 1)] for (tid, name), d in waits]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--variants", default="synthetic,1/0,2/0,2/-1,3/-1")
    p.add_argument("--modes", default="eager,graph")
    p.add_argument("--profile", help="variants (commas) to run once more per mode, 20 steps, under torch.profiler")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    folder = tempfile.mkdtemp(prefix="finish-under-load-")
    imagegen.write_folder(folder, "detailed", 1280, 16)
    train, batches = batches_of(folder, 10)
    print("decoder:", gpu_images.decoder_name(dev), flush=True)
    global CHOSEN, REUSING
    CHOSEN = jpeg_decoders.choose(dev)
    REUSING = ReusingDecoder(dev) if any(v.endswith("/r") for v in a.variants.split(",")) else None
    result = {"what": __doc__.split("\n")[0], "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
              "steps": a.steps, "decoder": jpeg_decoders.choose(dev).name, "modes": {}}
    for mode in a.modes.split(","):
        x, step = training_step(dev, graph=mode == "graph")
        rounds = {v: [] for v in a.variants.split(",")}
        for r in range(a.rounds):
            for v in rounds:
                rounds[v].append(round(run(x, step, batches, dev, a.steps, v, train.on_device), 1))
                print(mode, r, v, rounds[v][-1], flush=True)
        result["modes"][mode] = {"median": {v: statistics.median(r) for v, r in rounds.items()}, "rounds": rounds}
        print(mode, json.dumps(result["modes"][mode]["median"]), flush=True)
        for v in a.profile.split(",") if a.profile else []:
            trace = Path(a.out).with_suffix(f".{mode}.{v.replace('/', '_')}.trace.json")
            result["modes"][mode].setdefault("profile", {})[v] = profiled(
                lambda x=x, step=step, v=v: run(x, step, batches, dev, 20, v, train.on_device), trace)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
