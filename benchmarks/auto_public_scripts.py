"""`multigpu run --auto` on public one-GPU scripts that no one here wrote, unmodified: one command.

    export PYTHONPATH=$PWD/src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python benchmarks/auto_public_scripts.py --out $OUT --gpus 2,4          # GPU machine
    python benchmarks/auto_public_scripts.py --devices-kind cpu --out /tmp/apub   # CPU smoke
    python benchmarks/auto_public_scripts.py --corpus --devices-kind cpu --gpus 2 --out /tmp/corpus

--corpus [NAMES]: issue 38's corpus instead (benchmarks/auto_corpus.py lists it, with how to
fetch it into .public/corpus/; auto_corpus_check.py says what each verdict reads): three
one-process runs and --auto on each N of --gpus per script, a verdict per script.

The scripts are fetched, not committed: copy each, byte for byte, to `--scripts` (default
.public/, git-ignored) as named here; the run checks each file's git blob id against the pinned one.
- .public/mnist/main.py: github.com/pytorch/examples @ 77f55b912142e11fcfdf5b530231fb9c52f181e8,
  mnist/main.py (blob dee5a384cb2c43acf7c7ce8e521330ccd01c6e92).
- .public/imagenet/main.py: the same commit, imagenet/main.py (blob 42e5e9fa...), run in its
  one-process GPU mode (no --gpu, no --world-size): it wraps the model in nn.DataParallel.
- .public/cifar10_resnet/main.py: github.com/yunjey/pytorch-tutorial @
  0500d3df5a2a8080ccfccbc00aca0eacc21818db, tutorials/02-intermediate/deep_residual_network/main.py
  (blob 69dbe5fb...). Chosen because pytorch/tutorials' cifar10 tutorial trains on the CPU unless
  the reader edits it; this one is the best known tutorial-style CIFAR-10 loop that is GPU-ready as
  published (torch.device('cuda'), .to(device), shuffle=True, torch.save(state_dict)). It takes no
  arguments: 80 epochs, batch 100, Adam 1e-3, as written.

For each script: its data generated in the layout it reads (auto_public_data.py); 3 one-GPU runs
(`python main.py ARGS`, seeds 1..3 where the script takes --seed) and one
`multigpu run --auto --devices N main.py ARGS` for each N of --gpus, the same ARGS. Reported per run:
exit code, wall time, the final test accuracy parsed from the script's own output, the files it
saved (each expected one exactly once, nothing else), whether every training sample was fetched
once per epoch over all ranks (auto_public_record/sitecustomize.py records the indices each
process's loaders fetch), and for the ImageNet script its throughput from its own printed batch
times: global batch / mean batch time, the first --warmup batches of each epoch skipped, and the
speedup over its one-GPU run. The ImageFolder has 40960 training JPEGs (160 batches of 256) and a
run on N processes trains N epochs, so that every ImageNet run times at least about 10 s
(the one-GPU resnet18 run: 155 timed batches at about 3600 img/s, 11 s; 4 GPUs at the 3.5x
target: 620 batches, 12.5 s).

Why the ImageNet speedup falls short, in one command (`--compare`: the ImageNet set alone, in
turns on one machine): after the one-GPU run and its data loading alone (loader-1), for each N of
--gpus: `auto-N` (--auto), `ddp-N` (the script's own --multiprocessing-distributed mode, given
-j = workers x N so that each of its processes has --auto's batch -b/N and workers -j),
`per-gpu-N` (--auto-batch per-gpu: -b per GPU) and `loader-N` (auto_public_loader.py: the same
ImageFolder and transforms through a DataLoader per process, N processes at once, no GPU step).
GPU runs of several processes also record how NCCL joined them (P2P, SHM, NET: its INFO lines).
auto_public_report.py says how to read the lines it prints. On the GPU machine (4 GPUs), with
.public/ carried; about 6-7 min for resnet18 (the data: seconds, reused by a later call to the
same --out), about 7 min for resnet50 -j 14, each within one 10-minute device command:

    bash benchmarks/auto_public_compare.sh                            # resnet18, -j 10
    ARCH=resnet50 WORKERS=14 bash benchmarks/auto_public_compare.sh   # a second call

Each invocation works in a folder of its own, `--out/call-K` (K: one more than the last), so a
re-run into the same --out never mixes its runs' records, saved files or logs with an earlier
one's: results.json, results.txt and every run's logs are there, and the latest call's
results.json and results.txt are copied to --out. Only the ImageFolder, the costly data set, is
shared between calls (`--out/data/imagenet-TRAINxVAL`, reused once complete).

The one shim, the same for every run and said in results.json: torchvision's CIFAR10 checks that
its files exist instead of their md5 (see auto_public_record/sitecustomize.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import auto_corpus as corpus  # noqa: E402
import auto_corpus_check as corpus_check  # noqa: E402
import auto_public_data as data  # noqa: E402
import auto_public_report as report  # noqa: E402
import auto_public_runs as runs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# name: (file under --scripts, git blob id of the pinned file, data folder relative to the run's cwd)
SCRIPTS = {
    "mnist": ("mnist/main.py", "dee5a384cb2c43acf7c7ce8e521330ccd01c6e92", "../data"),
    "cifar": ("cifar10_resnet/main.py", "69dbe5fb0efa5e455c694af80c0378773fce19c7", "../../data"),
    "imagenet": ("imagenet/main.py", "42e5e9fa64f023f019689ab871332d5e3ffa2ab8", "../../data"),
}
SAVED = {"mnist": ["mnist_cnn.pt"], "cifar": ["resnet.ckpt"],
         "imagenet": ["checkpoint.pth.tar", "model_best.pth.tar"]}
# (GPU machine, CPU smoke): sample counts (train, test) and the scripts' own arguments
SIZES = {"mnist": ((60000, 10000), (512, 256)), "cifar": ((3000, 2000), (200, 100)),
         "imagenet": ((40960, 512), (32, 16))}
COMPARE_MODES = "auto,ddp,per-gpu,loader"


def script_args(job: runs.Job, args) -> list[str]:
    cpu = args.devices_kind == "cpu"
    if job.name == "mnist":
        extra = ["--seed", str(job.seed)] if job.seed is not None else []
        return ["--epochs", "1" if cpu else str(args.mnist_epochs), "--save-model",
                "--log-interval", "50"] + extra
    if job.name == "cifar":
        return []  # the script takes no arguments
    return imagenet_args(job, args, cpu)


def imagenet_args(job: runs.Job, args, cpu: bool) -> list[str]:
    """The same -b and -j (per process: what --auto makes of them) in every mode. Epochs grow
    with the process count, so that each run times about as many seconds."""
    epochs = 1 if cpu else args.imagenet_epochs_per_gpu * job.devices
    batch, workers = (8, 1) if cpu else (args.imagenet_batch, args.imagenet_workers)
    if job.mode == "loader":
        return [str(job.data_dir), "--procs", str(job.devices), "-b", str(batch),
                "-j", str(workers), "--epochs", str(epochs), "--warmup", str(args.warmup)]
    if job.mode == "ddp":  # the script gives each process ceil(-j / N) workers and -b / N
        workers *= job.devices
    return [str(job.data_dir), "-a", args.imagenet_arch, "--epochs", str(epochs),
            "-b", str(batch), "-j", str(workers), "-p", "1"]


def generate(name: str, root: Path, cpu: bool) -> float | None:
    """Writes the data set into `root`; None when a shared one is there already, complete."""
    train, test = SIZES[name][1 if cpu else 0]
    done = root / ".complete"
    if done.is_file():
        return None
    start = time.perf_counter()
    writer = {"mnist": data.write_mnist, "cifar": data.write_cifar,
              "imagenet": data.write_imagefolder}[name]
    writer(root, train, test)
    done.write_text(f"{train} {test}\n")
    return time.perf_counter() - start


def data_folder(name: str, cwd: Path, out: Path, cpu: bool) -> Path:
    """Where a run reads its data: MNIST and CIFAR where the script looks (relative to its cwd,
    in the call's folder, cheap to write); the ImageFolder shared by every call to --out."""
    if name != "imagenet":
        return (cwd / SCRIPTS[name][2]).resolve()
    train, test = SIZES[name][1 if cpu else 0]
    return out / "data" / f"imagenet-{train}x{test}"


def claim_call_folder(out: Path) -> Path:
    """A new, empty `out/call-K` for this invocation (K one more than the highest there)."""
    taken = [int(p.name[5:]) for p in out.glob("call-*") if p.name[5:].isdigit()]
    k = max(taken, default=0) + 1
    while True:
        try:
            (out / f"call-{k}").mkdir(parents=True)
            return out / f"call-{k}"
        except FileExistsError:  # another invocation took it meanwhile
            k += 1


def plan(args, call: Path) -> list[runs.Job]:
    """Every run, ImageNet's first (each alone on the machine: its throughput is measured), in
    the call's own folder."""
    jobs, scripts = [], Path(args.scripts).resolve()
    counts = [int(n) for n in args.gpus.split(",") if n]
    for name in sorted(args.only.split(","), key=lambda n: n != "imagenet"):
        script = scripts / SCRIPTS[name][0]
        runs_dir = call / name / "runs"
        if name == "imagenet":
            jobs += imagenet_jobs(script, runs_dir, counts, args)
            continue
        seeds = [1, 2, 3] if name == "mnist" else [None] * 3
        for i, seed in enumerate(seeds):
            jobs.append(runs.Job(name, script, runs_dir / f"1gpu-{i + 1}", 1, "1gpu", seed, False))
        for n in counts:
            jobs.append(runs.Job(name, script, runs_dir / f"auto-{n}", n, "auto", seeds[0], False))
    for job in jobs:
        job.data_dir = data_folder(job.name, job.cwd, call.parent, args.devices_kind == "cpu")
        job.args = script_args(job, args)
    return jobs


def imagenet_jobs(script: Path, runs_dir: Path, counts: list[int], args) -> list[runs.Job]:
    """The one-GPU run, then each mode on each process count, in turns; --rounds times."""
    modes = [m for m in args.imagenet_modes.split(",") if m]
    jobs = []
    for k in range(1, args.rounds + 1):
        tag = f"-r{k}" if args.rounds > 1 else ""
        plan = [("1gpu", 1)] + [("loader", 1)] * ("loader" in modes)
        plan += [(mode, n) for n in counts for mode in modes]
        jobs += [runs.Job("imagenet", script, runs_dir / f"{mode}-{n}{tag}", n, mode, None, True)
                 for mode, n in plan]
    return jobs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scripts", default=str(REPO / ".public"))
    p.add_argument("--out", default=os.environ.get("OUT") or "auto_public_out")
    p.add_argument("--gpus", default="2,4", help="process counts for --auto, e.g. 2,4")
    p.add_argument("--devices-kind", choices=["gpu", "cpu"], default="gpu",
                   help="cpu: a local smoke run (--devices cpu:N, tiny data, 1 epoch)")
    p.add_argument("--only", default="mnist,cifar,imagenet")
    p.add_argument("--mnist-epochs", type=int, default=2)
    p.add_argument("--imagenet-arch", default="resnet18")
    p.add_argument("--imagenet-batch", type=int, default=256)
    p.add_argument("--imagenet-workers", type=int, default=10)
    p.add_argument("--imagenet-epochs-per-gpu", type=int, default=1,
                   help="a run on N processes trains N times this many epochs")
    p.add_argument("--imagenet-modes", default="auto",
                   help=f"ImageNet runs beside the one-GPU one, of {','.join(runs.MODES[1:])}")
    p.add_argument("--rounds", type=int, default=1, help="the ImageNet set, this many times")
    p.add_argument("--compare", action="store_true",
                   help=f"the ImageNet set only, on --gpus, in the modes {COMPARE_MODES}")
    p.add_argument("--warmup", type=int, default=5, help="ImageNet batches not timed")
    p.add_argument("--slots", type=int, default=2,
                   help="runs sharing one GPU at once (not the ImageNet runs, which run alone)")
    p.add_argument("--run-timeout", type=int, default=240)
    p.add_argument("--corpus", nargs="?", const=",".join(corpus.CORPUS), default=None,
                   metavar="NAMES", help="issue 38's corpus (all, or these names) instead")
    p.add_argument("--one-process-runs", type=int, default=3,
                   help="--corpus: one-process runs per script, whose range the metric is held to")
    p.add_argument("--auto-runs", type=int, default=1,
                   help="--corpus: --auto runs per script and process count")
    p.add_argument("--baseline", metavar="RESULTS_JSON", default=None,
                   help="--corpus: hold the metric to the one-process runs of an earlier call "
                        "(its results.json) instead of this call's")
    p.add_argument("--recollect", metavar="CALL", default=None,
                   help="--corpus: read the runs of an earlier call folder again (no new run)")
    args = p.parse_args(argv)
    if args.corpus is not None:
        return run_corpus(args)
    if args.compare:
        args.only, args.imagenet_modes = "imagenet", COMPARE_MODES
    wrong = set(args.imagenet_modes.split(",")) - set(runs.MODES[1:])
    if wrong:
        p.error(f"--imagenet-modes: {','.join(sorted(wrong))} is not one of "
                f"{','.join(runs.MODES[1:])}")
    cpu = args.devices_kind == "cpu"
    out = Path(args.out).resolve()
    names = args.only.split(",")
    provenance = runs.check_scripts({n: SCRIPTS[n][:2] for n in names}, Path(args.scripts))
    if any(not v["unmodified"] for v in provenance.values()):
        print(json.dumps(provenance, indent=1), file=sys.stderr)
        print("auto_public_scripts: a script is missing or differs from its pinned blob; copy it "
              "unmodified (see this file's docstring)", file=sys.stderr)
        return 2
    call = claim_call_folder(out)
    print(f"[call] {call}", flush=True)
    jobs = plan(args, call)
    gen = {}
    for name in names:
        root = {j.data_dir for j in jobs if j.name == name}.pop()
        took = generate(name, root, cpu)
        gen[name] = None if took is None else round(took, 1)
        print(f"[data] {name}: {SIZES[name][int(cpu)]} samples in {root} "
              f"({'reused' if took is None else f'{gen[name]} s'})", flush=True)
    runs.run_all(jobs, cpu=cpu, slots=args.slots, timeout=args.run_timeout, repo=REPO)
    results = [runs.collect(j, SAVED[j.name], args.warmup) for j in jobs]
    summary = report.summarise(results)
    doc = {"scripts": provenance, "data_seconds": gen, "devices_kind": args.devices_kind,
           "shims": ["torchvision.datasets.cifar.check_integrity: the file exists (no md5), "
                     "auto_public_record/sitecustomize.py"],
           "env": runs.FIXED_ENV, "runs": results, "summary": summary}
    table = report.table(results, summary)
    for folder in (call, out):  # the call's own, and the latest call's at --out
        (folder / "results.json").write_text(json.dumps(doc, indent=1))
        (folder / "results.txt").write_text(table)
    print(table)
    return 0


def run_corpus(args) -> int:
    """The corpus: its pins checked, its data generated, its runs, a verdict per script."""
    names = [n for n in args.corpus.split(",") if n]
    unknown = sorted(set(names) - set(corpus.CORPUS))
    if unknown:
        print(f"auto_public_scripts: --corpus: {','.join(unknown)} not in auto_corpus.CORPUS",
              file=sys.stderr)
        return 2
    scripts, out = Path(args.scripts).resolve(), Path(args.out).resolve()
    pins = {f"{n}:{pin.path}": (str(corpus.pin_path(corpus.CORPUS[n], pin, scripts)
                                    .relative_to(scripts)), pin.blob)
            for n in names for pin in corpus.CORPUS[n].pins()}
    provenance = runs.check_scripts(pins, scripts)
    if any(not v["unmodified"] for v in provenance.values()):
        print(json.dumps(provenance, indent=1), file=sys.stderr)
        print("auto_public_scripts: a corpus file is missing or differs from its pinned blob; "
              "python benchmarks/auto_corpus.py --materialise MIRRORS writes them", file=sys.stderr)
        return 2
    if args.recollect:
        call = Path(args.recollect).resolve()
        jobs = corpus_check.load_jobs(call)
    else:
        call = claim_call_folder(out)
        print(f"[call] {call}", flush=True)
        counts = [int(n) for n in args.gpus.split(",") if n]
        jobs = corpus_check.plan(names, scripts, call, counts, args.one_process_runs,
                                 args.auto_runs)
        links = {n: corpus_check.generate(n, call) for n in names}
        for job in jobs:
            corpus_check.prepare(job, scripts, links[job.name])
        runs.run_all(jobs, cpu=args.devices_kind == "cpu", slots=1, timeout=args.run_timeout,
                     repo=REPO, extra=corpus_check.ENV)
        corpus_check.save_jobs(jobs, call)
    results = [corpus_check.collect(j) for j in jobs]
    baseline = None
    if args.baseline:
        earlier = json.loads(Path(args.baseline).read_text())["summary"]
        baseline = {n: s["one_process"] for n, s in earlier.items()}
    summary = corpus_check.summarise(results, baseline)
    doc = {"scripts": provenance, "devices_kind": args.devices_kind, "gpus": args.gpus,
           "baseline": args.baseline,
           "shims": ["torchvision.datasets.cifar.check_integrity: the file exists (no md5)",
                     "torchvision's nms/qnms schemas defined where its compiled ops do not load"],
           "env": runs.FIXED_ENV | corpus_check.ENV, "runs": results, "summary": summary}
    table = corpus_check.table(summary)
    for folder in (call, out):
        (folder / "results.json").write_text(json.dumps(doc, indent=1))
        (folder / "results.txt").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
