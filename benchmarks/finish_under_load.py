"""The GPU decode path's finishing helpers under a training step's load, in variants that take turns.

    PYTHONPATH=src python benchmarks/finish_under_load.py --out FILE.json [--rounds 3] [--steps 60]

A ResNet-50 training step (bf16, channels_last, SGD, batch 128) runs in the main thread, eager or
replayed as one CUDA graph, each step's input copied from the next finished batch; the batches
(ImageBatch, still encoded, as loader workers hand them over, from a generated folder of detailed
JPEGs in memory: no workers, no files) are decoded and cropped by prefetch_thread.finish_in_thread,
as `multigpu train --decode gpu` runs them.

Variants: THREADS/PRIORITY, helpers on streams of PRIORITY (0 or -1, higher), and flags after it
that combine (2/0/f/h): /f nvImageCodec decoding into new Images each batch (its decode, as
before the product's decode_transient reused the previous batch's: round 7's /r); /c
nvImageCodec's CUDA decoder instead of the hardware engines; /n the decode alone (the step not
run); /h the step on a stream of the highest priority (the decoder library's own streams and
the helpers' below it); /s the host queueing at most 2 steps ahead of
the GPU (asleep on an event meanwhile, the GIL free). `synthetic` is the same step on a fixed
batch, nothing decoded (synthetic/s: paced). Per mode (eager, graph, and stand-ins for the step
that train nothing, `mm`, `bw`, `mmgap`: stand_in_step) the variants take turns, round by round;
images a second of each, the median round.

Each run also reports Phases: the helpers' time a batch in its parts, and how late a sleeping
thread wakes (the GIL held elsewhere).

--profile VARIANTS: after the rounds, each once more per mode (30 steps, 20 timed) under
torch.profiler, whose CUPTI tracing records every CUDA runtime and driver call and kernel of the
process (the decoder library's threads' too): the calls that held a thread longest, and
trace_summary's view (each stream's kernel time, the GPU busy with anything), printed and written
beside --out with the trace.
"""
import argparse
import collections
import json
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from gpu_path_contention import resnet50_parts  # benchmarks/, the script's own folder on sys.path
from multigpu.bench import imagegen
from multigpu.core.loading.data import move_to_device
from multigpu.core.loading.prefetch_thread import finish_in_thread
from multigpu.train.data import gpu_images, imagefolder, jpeg_decoders


def stand_in_step(dev, kind: str, batch: int = 128):
    """(static input, step()): one CUDA graph of about a ResNet-50 step's GPU time (~29 ms on an
    H200) that is not training: "mm", bf16 matrix products (the SMs' math busy); "bw", copies of
    a 2 GiB tensor (the memory's bandwidth busy); "mmgap", mm's products as 10 graphs of 2, the
    host waiting for each (the GPU idle for a moment between them). Which slows the decode?"""
    x = torch.zeros(batch, 3, 224, 224, device=dev)
    if kind in ("mm", "mmgap"):
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        a2 = torch.empty_like(a)
        work, repeat = (lambda: torch.mm(a, a, out=a2)), 20 if kind == "mm" else 2
    else:
        big = torch.empty(2**30, device=dev, dtype=torch.float16)
        other = torch.empty_like(big)
        work, repeat = (lambda: other.copy_(big)), 30
    work()
    torch.cuda.synchronize(dev)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        for _ in range(repeat):
            work()
    step = captured.replay
    if kind == "mmgap":
        def step():
            for _ in range(10):
                captured.replay()
                torch.cuda.current_stream(dev).synchronize()
    step()
    torch.cuda.synchronize(dev)
    began = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize(dev)
    print(f"stand-in step {kind}: {(time.perf_counter() - began) / 5 * 1000:.1f} ms", flush=True)
    return x, step


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


class Phases:
    """Over one run: the helpers' milliseconds a batch in each part of its finishing (move: the
    copy to the device queued; decode: the decoder's call; finish: all of it), and how late a
    thread that sleeps 0.5 ms at a time wakes (another thread holding the GIL keeps it out)."""

    def __init__(self):
        self.seconds, self.counts = collections.Counter(), collections.Counter()
        self.late: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._probe = threading.Thread(target=self._sleeper, daemon=True)

    @contextmanager
    def part(self, name: str):
        began = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[name] += time.perf_counter() - began
                self.counts[name] += 1

    def _sleeper(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            time.sleep(0.0005)
            self.late.append(time.perf_counter() - began - 0.0005)

    def __enter__(self):
        self._probe.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._probe.join()

    def summary(self) -> dict:
        batches = max(self.counts["finish"], 1)
        late = sorted(self.late) or [0.0]
        return {**{f"{k}_ms": round(v * 1000 / batches, 2) for k, v in self.seconds.items()},
                "late_ms": {q: round(late[min(int(f * len(late)), len(late) - 1)] * 1000, 2)
                            for q, f in (("p50", .5), ("p90", .9), ("p99", .99), ("max", 1.0))},
                "late_share": round(sum(late) / max(sum(late) + 0.0005 * len(late), 1e-9), 3)}


class TimedDecoder(jpeg_decoders.JpegDecoder):
    """`inner`'s decode, its time counted in `phases` as "decode"; the crops' call goes to its
    decode_transient, or with `fresh` to its decode (new Images every batch)."""

    def __init__(self, inner, phases: Phases, fresh: bool = False):
        self.inner, self.phases, self.name, self.threads = inner, phases, inner.name, inner.threads
        self.fresh = fresh

    def decode(self, encoded, device):
        with self.phases.part("decode"):
            return self.inner.decode(encoded, device)

    def decode_transient(self, encoded, device):
        if self.fresh:
            return self.decode(encoded, device)
        with self.phases.part("decode"):
            return self.inner.decode_transient(encoded, device)


def _no_step() -> None:
    pass


# set in main: the run's decoder, nvImageCodec's CUDA decoder (".../c": no hardware engines; or why
# it did not start)
CHOSEN = CUDA_DECODER = None


def run(x, step, batches, dev, steps: int, variant: str, finish, phases: Phases | None = None) -> float:
    if variant.startswith("synthetic"):  # synthetic/s: paced
        source = ((k, None) for k in range(steps + 10))
        return _timed(source, x, step, dev, steps, 2 if variant.endswith("/s") else 0)
    threads, priority, *flags = variant.split("/")
    phases = phases or Phases()
    chosen = CUDA_DECODER if "c" in flags else CHOSEN
    if isinstance(chosen, str):
        print(f"variant {variant}: {chosen}", flush=True)
        return 0.0
    jpeg_decoders.use(dev, TimedDecoder(chosen, phases, fresh="f" in flags))
    if "n" in flags:  # the decode alone: the step's input is still copied, the step not run
        step = _no_step

    def prepare(batch):
        with phases.part("finish"):
            with phases.part("move"):
                moved = move_to_device(batch, dev, True)
            return finish(moved, dev)

    pairs = ((k, batches[k % len(batches)]) for k in range(steps + 10))
    source = finish_in_thread(pairs, dev, prepare, threads=int(threads), priority=int(priority))
    # /h: the step (and its input's copy) on a stream of the highest priority torch gives
    stream = torch.cuda.Stream(dev, priority=-3) if "h" in flags else torch.cuda.current_stream(dev)
    with torch.cuda.stream(stream):
        return _timed(source, x, step, dev, steps, 2 if "s" in flags else 0)


def _timed(source, x, step, dev, steps: int, ahead: int) -> float:
    """Images a second over `steps` steps after 10; with `ahead`, the host waits (asleep) before
    queueing a step while `ahead` steps are still queued on the GPU."""
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    queued: list = []
    for k, batch in source:
        if k == 10:  # the helpers' queue filled, the step settled
            torch.cuda.synchronize(dev)
            began = time.perf_counter()
        if ahead and len(queued) >= ahead:
            queued.pop(0).synchronize()
        if batch is not None:
            x.copy_(batch[0].float().sub_(mean))
        step()
        if ahead:
            queued.append(torch.cuda.Event(blocking=True))
            queued[-1].record()
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
    p.add_argument("--profile", help="variants (commas) to run once more per mode (30 steps, 20 timed), profiled")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    folder = tempfile.mkdtemp(prefix="finish-under-load-")
    imagegen.write_folder(folder, "detailed", 1280, 16)
    train, batches = batches_of(folder, 10)
    print("decoder:", gpu_images.decoder_name(dev), flush=True)
    global CHOSEN, CUDA_DECODER
    CHOSEN = jpeg_decoders.choose(dev)
    if any("/c" in v for v in a.variants.split(",")):
        try:
            CUDA_DECODER = jpeg_decoders.NvImageCodecDecoder(dev, hardware=False)
        except Exception as exc:
            CUDA_DECODER = f"nvImageCodec's CUDA decoder did not start ({str(exc).splitlines()[0][:120]})"
    result = {"what": __doc__.split("\n")[0], "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev),
              "steps": a.steps, "decoder": jpeg_decoders.choose(dev).name, "modes": {}}
    for mode in a.modes.split(","):
        stand_in = mode in ("mm", "bw", "mmgap")
        x, step = stand_in_step(dev, mode) if stand_in else training_step(dev, graph=mode == "graph")
        rounds = {v: [] for v in a.variants.split(",")}
        parts = {v: [] for v in rounds}
        for r in range(a.rounds):
            for v in rounds:
                with Phases() as phases:
                    rounds[v].append(round(run(x, step, batches, dev, a.steps, v, train.on_device, phases), 1))
                parts[v].append(phases.summary())
                print(mode, r, v, rounds[v][-1], json.dumps(parts[v][-1]), flush=True)
        result["modes"][mode] = {"median": {v: statistics.median(r) for v, r in rounds.items()}, "rounds": rounds,
                                 "phases": parts}
        print(mode, json.dumps(result["modes"][mode]["median"]), flush=True)
        for v in a.profile.split(",") if a.profile else []:
            trace = Path(a.out).with_suffix(f".{mode}.{v.replace('/', '_')}.trace.json")
            result["modes"][mode].setdefault("profile", {})[v] = profiled(
                lambda x=x, step=step, v=v: run(x, step, batches, dev, 20, v, train.on_device), trace)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
