"""What each crop_resize variant costs, alone and to a training step beside it, on one GPU.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \
        python benchmarks/crop_resize_cost.py --out benchmarks/results/crop_resize_cost

Images: 128 decoded pictures of the detailed folder's sizes (multigpu.bench.imagegen, sides
225-800), made here as uint8 tensors on the GPU (no files, no decoder); boxes and flips are the
training crop's (imagefolder._random_box), a new draw for each of --batches batches. For each
variant of crop_resize.VARIANTS, in turns (the order rotated each trial), medians of --trials:
  (a) crop_ms: wall time of one batch of 128 crops, synchronised; kernel_ms: the GPU kernels'
      summed time for one batch (torch.profiler, once): the GPU time the crops take from others;
  (b) step_ms: the ResNet-50 bf16 b128 step (gpu_path_contention's) with the variant running
      without pause in a thread on a side stream, beside the step alone in the same trial;
      thread_img_s: what that thread made meanwhile (the step needs 128000 / step_ms);
  (c) pil_max / pil_mean: abs difference of the rounded crops to PIL's (imagefolder._resize_box,
      the CPU path) on the first --pil-images images.
Writes OUT/crop_resize_cost.json and OUT/crop_resize_cost.md (the table, also printed).
About 60-90 s on one H100.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_key, "0" if _key == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402 (the NVLS switches above are set before torch loads)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_path_contention import resnet50_step, time_steps, with_thread  # noqa: E402

from multigpu.bench import imagegen  # noqa: E402
from multigpu.train.data import crop_resize, imagefolder  # noqa: E402

SIZE = 224


def make_inputs(count: int, batches: int, dev):
    """(PIL pictures, uint8 tensors on dev, [(boxes, flips)] a batch)."""
    pictures = [imagegen.make_image("detailed", seed).convert("RGB") for seed in range(count)]
    tensors = [imagefolder._to_tensor(p).to(dev) for p in pictures]
    generator = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(batches):
        boxes = [imagefolder._random_box(p.width, p.height, generator) for p in pictures]
        flips = [bool(torch.randint(2, (1,), generator=generator)) for _ in pictures]
        draws.append((boxes, flips))
    return pictures, tensors, draws


def crop_ms(fn, tensors, draws) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for boxes, flips in draws:
        fn(tensors, boxes, flips, SIZE)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / len(draws) * 1000


def kernel_ms(fn, tensors, draws) -> float | None:
    """Summed GPU kernel time of one batch, or None where the profiler cannot see the GPU."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            boxes, flips = draws[0]
            fn(tensors, boxes, flips, SIZE)
            torch.cuda.synchronize()
        return sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                   for e in prof.key_averages()) / 1000
    except Exception as exc:  # a profiler without CUPTI: the other figures still stand
        print(f"kernel time not measured ({exc})", flush=True)
        return None


def pil_agreement(fn, pictures, tensors, draws, count: int) -> tuple[float, float]:
    boxes, flips = (d[:count] for d in draws[0])
    ours = fn(tensors[:count], boxes, flips, SIZE).round().clamp(0, 255).cpu()
    pil = torch.stack([imagefolder._to_tensor(imagefolder._resize_box(p, b, f, SIZE))
                       for p, b, f in zip(pictures[:count], boxes, flips)]).float()
    diff = (ours - pil).abs()
    return float(diff.max()), float(diff.mean())


def trials(variants, step, tensors, draws, args, dev) -> dict:
    side = torch.cuda.Stream(dev)
    got = {name: {"crop_ms": [], "step_ms": [], "thread_img_s": []} for name in variants}
    alone = []
    for trial in range(args.trials):
        order = variants[trial % len(variants):] + variants[:trial % len(variants)]
        alone.append(time_steps(step, args.steps))
        for name in order:
            fn = crop_resize.VARIANTS[name]
            with torch.cuda.stream(side):
                got[name]["crop_ms"].append(crop_ms(fn, tensors, draws))

            def work(k, fn=fn):
                boxes, flips = draws[k % len(draws)]
                fn(tensors, boxes, flips, SIZE)
            ms, rate = with_thread(work, lambda: time_steps(step, args.steps), dev, side, len(tensors))
            got[name]["step_ms"].append(ms)
            got[name]["thread_img_s"].append(rate)
        print(f"trial {trial}: alone {alone[-1]:.1f} ms; " + ", ".join(
            f"{n} {got[n]['step_ms'][-1]:.1f}" for n in variants), flush=True)
    return {"alone_step_ms": alone, "variants": got}


def table(result: dict) -> str:
    alone = result["alone_step_ms_median"]
    trials = len(result["alone_step_ms"])
    lines = [f"{result['device']}, torch {result['torch']}; step alone {alone:.1f} ms (median of {trials})",
             "| variant | crop ms/batch | kernel ms/batch | step ms beside it | step slowdown | thread img/s "
             "| vs PIL max / mean |",
             "|---|---|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        kernel = "-" if v["kernel_ms"] is None else f"{v['kernel_ms']:.2f}"
        lines.append(f"| {name} | {v['crop_ms_median']:.2f} | {kernel} | {v['step_ms_median']:.1f} | "
                     f"{v['step_ms_median'] / alone - 1:+.0%} | {v['thread_img_s_median']:.0f} | "
                     f"{v['pil_max']:.0f} / {v['pil_mean']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for crop_resize_cost.json and .md")
    parser.add_argument("--variants", default=",".join(crop_resize.VARIANTS))
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps a step-time measurement")
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--pil-images", type=int, default=8)
    args = parser.parse_args()
    started = time.perf_counter()
    dev = torch.device("cuda", 0)
    variants = args.variants.split(",")
    pictures, tensors, draws = make_inputs(args.images, args.batches, dev)
    step = resnet50_step(dev)
    for _ in range(15):
        step()
    agreement, kernels = {}, {}
    for name in variants:  # also the warm-up of each variant (cuBLAS, torchvision's import)
        agreement[name] = pil_agreement(crop_resize.VARIANTS[name], pictures, tensors, draws, args.pil_images)
        kernels[name] = kernel_ms(crop_resize.VARIANTS[name], tensors, draws)
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "args": vars(args)}
    result |= trials(variants, step, tensors, draws, args, dev)
    result["alone_step_ms_median"] = statistics.median(result["alone_step_ms"])
    for name, v in result["variants"].items():
        for key in ("crop_ms", "step_ms", "thread_img_s"):
            v[f"{key}_median"] = statistics.median(v[key])
        v["kernel_ms"] = kernels[name]
        v["pil_max"], v["pil_mean"] = agreement[name]
    result["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "crop_resize_cost.json").write_text(json.dumps(result, indent=1))
    (out / "crop_resize_cost.md").write_text(table(result) + "\n")
    print(table(result))
    print(f"{result['seconds']:.0f} s; wrote {out / 'crop_resize_cost.json'}")


if __name__ == "__main__":
    main()
