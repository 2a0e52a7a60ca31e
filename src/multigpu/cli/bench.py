"""`multigpu bench`: time our training step on 1 GPU, DataParallel and DDP, next to the peers.

The parent checks the flags, picks the devices, then starts each group of measurements through
multigpu's launcher (see multigpu.bench.spec for the grouping) and writes a table, a JSON file and
a PNG plot.
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys

from multigpu.bench.spec import DDP_VARIANTS, DEFAULT_METHODS, METHODS
from multigpu.core.system import fileio
from multigpu.core.compiling import MODES as COMPILE_MODES
from multigpu.train.models.model_names import MODEL_NAMES

EXAMPLES = """\
examples:
  multigpu bench --model resnet50 --batch-size 128 --precision bf16 --gpus 1,2,4
  multigpu bench --batch-size 32,64,256 --gpus 4 --methods multigpu-single,multigpu-ddp,ddp
  multigpu bench --model resnet50 --data synthetic,real --methods multigpu-single,multigpu-ddp --gpus 1,4
  multigpu bench --model resnet50 --compile reduce-overhead --methods multigpu-single,multigpu-ddp --gpus 1,4
  multigpu bench --model swin_t,vgg16 --methods multigpu-single,multigpu-ddp --gpus 1,4
  multigpu bench --gpus 4 --methods multigpu-single,multigpu-ddp,multigpu-ddp:static,multigpu-ddp:bf16hook,ddp
  multigpu bench --model mlp --devices cpu:2 --gpus 1,2 --steps 3 --warmup 1 --image-size 8

img/s is global (all GPUs); scaling = img/s / (GPUs x multigpu-single img/s) of the same run;
of synth. = real-data img/s / synthetic img/s of the same method, model, batch and GPUs;
real data is timed in its steady state: the batches its loader queued during the warm-up
are taken off unused first, so a trial never runs on a prefetch burst;
MFU = FLOPs of one GPU's forward+backward / step time / the GPU's dense bf16 peak.
Methods with the same model, batch, data and GPUs take turns trial by trial, so a drifting
machine (up to 27 % within minutes on 4x H200) does not favour one; compare figures within one run.
That is how to compare DDP settings too: each multigpu-ddp:VARIANT is a method of its own.
"""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmark our training step against hand-written DDP, Accelerate, Fabric",
        description="Time multigpu's own training step (single GPU, DataParallel, DDP) and the "
                    "peers' recipes on the same model and data; print a table, write JSON + PNG.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default="resnet50", metavar="NAME[,NAME...]",
      help=f"model(s): {', '.join(MODEL_NAMES)} (default resnet50)")
    a("--batch-size", default="128", metavar="B[,B...]",
      help="samples per GPU per step, one or several (default 128)")
    a("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
      help="auto = bf16 on GPUs that have it, else fp32; fp32 for lstm and tst (default auto)")
    a("--gpus", default="auto", metavar="N[,N...]",
      help="GPU counts to measure (CPU processes with --devices cpu:N); default 1,2,4,... up to all")
    variants = ", ".join(f"{name} ({v.about})" for name, v in DDP_VARIANTS.items())
    a("--methods", default=",".join(DEFAULT_METHODS), metavar="M[,M...]",
      help=f"any of {','.join(METHODS)} (default all but multigpu-fsdp; peers not installed are "
           f"skipped), and "
           f"multigpu-ddp:VARIANT, multigpu-ddp with one DDP setting changed, timed in turns with "
           f"it: {variants}")
    a("--data", default="synthetic", metavar="KIND[,KIND]",
      help="synthetic: one random batch kept on the GPU (compute + communication only); real: a "
           "generated JPEG folder through multigpu's whole input pipeline (decoded as `multigpu "
           "train --decode auto` does); folder:PATH: the same on your ImageFolder folder; real-cpu: "
           "the real data decoded by the loader workers; real-gpu: on the GPU alone; "
           "several: in the same launches, to show real as a share of synthetic (default "
           "synthetic; peers run on synthetic data only)")
    a("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES, metavar="MODE",
      help="torch.compile the model of the multigpu methods in MODE, as `multigpu train --compile "
           "MODE` does: default (--compile alone) or reduce-overhead (CUDA graphs), max-autotune, "
           "max-autotune-no-cudagraphs; it compiles during the warm-up (peers are not compiled)")
    a("--steps", type=int, default=30, help="timed steps per trial (default 30)")
    a("--warmup", type=int, default=10, help="untimed steps before the trials (default 10)")
    a("--trials", type=int, default=3, help="timed trials; the table shows their median (default 3)")
    a("--dp-steps", type=int, default=None, metavar="N",
      help="steps per trial (and at most N warm-up steps) for multigpu-dp, which can be very slow "
           "(default: --steps)")
    a("--image-size", type=int, default=None, help="image side (default: the model's, 224 for resnet50)")
    a("--devices", default="auto", help="GPUs to use: auto | N | 0,3 | cpu:N (default auto)")
    a("--min-free-memory", type=float, default=2.0, metavar="GIB",
      help="GiB a GPU must have free for --devices auto|N to take it (default 2)")
    a("--out", default=None, metavar="FILE.json|DIR",
      help="results file (default benchmarks/results/<date>-<machine>.json; the PNG goes beside it)")
    a("--data-dir", default=None, metavar="DIR",
      help="cache for the generated images of --data real (default ~/.cache/multigpu/bench-images)")
    a("--images", default="smooth", choices=("smooth", "detailed"),
      help="the generated images of --data real: smooth (256 px squares, cheap to decode) or "
           "detailed (like ImageNet's files: ~100 KB, mixed sizes around 500x375, a few greyscale "
           "and CMYK) (default smooth)")
    return p


def settings_from_args(args: argparse.Namespace):
    from multigpu.bench.spec import (BenchSettings, parse_data, parse_folder, parse_int_list, parse_methods,
                                     parse_models, validate)

    s = BenchSettings(
        models=parse_models(args.model),
        batch_sizes=parse_int_list(args.batch_size, "--batch-size"),
        precision=args.precision,
        gpus=None if str(args.gpus).strip() == "auto" else parse_int_list(args.gpus, "--gpus"),
        methods=parse_methods(args.methods), data=parse_data(args.data), folder=parse_folder(args.data),
        compile=args.compile,
        steps=args.steps, warmup=args.warmup, trials=args.trials, dp_steps=args.dp_steps,
        image_size=args.image_size, devices=args.devices, min_free_memory=args.min_free_memory,
        out=args.out, data_dir=args.data_dir, images=args.images,
        command=shlex.join(["multigpu", *sys.argv[1:]]))
    validate(s)
    if s.out:
        fileio.check_can_make(s.out, "--out")
    if s.data_dir and any(d.startswith("real") for d in s.data):  # where its images are made
        fileio.check_can_make(s.data_dir, "--data-dir")
    return s


def main(args: argparse.Namespace) -> int:
    from multigpu.core import console

    settings = settings_from_args(args)
    from multigpu.bench import report, run_bench  # torch: only once the flags are known good

    # A time limit (`timeout`) sends SIGTERM: stop like Ctrl-C, keeping what was measured.
    signal.signal(signal.SIGTERM, _interrupt)
    result = run_bench(settings)
    report.print_table(result)
    png = f" and {result['png']}" if result["png"] else ""
    console.info(f"multigpu bench: wrote {result['json']}{png}")
    planned_missing = any("planned measurements are missing" in n for n in result["notes"])
    return 1 if planned_missing or not result["rows"] else 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt
