"""Starting, scheduling and reading the runs of benchmarks/auto_public_scripts.py.

GPU machine: each run gets its GPUs through CUDA_VISIBLE_DEVICES (and its own lease folder, so
that runs sharing a GPU do not refuse each other); MNIST and CIFAR runs share GPUs (--slots), the
ImageNet runs, whose throughput is measured, run alone on the machine. CPU smoke: one after another.

A run's mode (MODES) says what it starts: the script itself on one GPU (1gpu), under
`multigpu run --auto` (auto; per-gpu: with --auto-batch per-gpu), in its own multi-GPU mode (ddp:
pytorch/examples' ImageNet script's --multiprocessing-distributed, which starts one process per
visible GPU), or its training data loading alone (loader: auto_public_loader.py).
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# PYTHONUNBUFFERED: each print written whole at once, as `multigpu run` has it: in ddp mode the N
# processes share one log, and block-buffered 8 KiB writes would splice their lines mid-line
# (a batch time read from another rank's half line).
FIXED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1", "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
RECORDER = Path(__file__).resolve().parent / "auto_public_record"
LOADER = Path(__file__).resolve().parent / "auto_public_loader.py"
MODES = ("1gpu", "auto", "per-gpu", "ddp", "loader")
# GPU runs of several processes say at start how NCCL connects them (P2P over NVLink or PCIe,
# SHM through host memory, NET): under --auto each process sees only its own GPU, in the script's
# own mode every GPU, and a slower transport for one of them would cost it every step.
NCCL_TRACE = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
TRANSPORT = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : \d+\[[^\]]*\] -> \d+\[[^\]]*\] via (\S+)")
ACCURACY = {  # the script's own last accuracy line: (regex, how to read it)
    "mnist": (r"Test set: Average loss: [-\d.naif]+, Accuracy: (\d+)/(\d+)",
              lambda m: 100.0 * int(m[0]) / int(m[1])),
    "cifar": (r"Accuracy of the model on the test images: ([\d.]+) %", lambda m: float(m[0])),
    "imagenet": (r"^ \*\s+Acc@1 ([\d.]+)", lambda m: float(m[0])),
}
BATCH_TIME = re.compile(r"^Epoch: \[\d+\]\[\s*(\d+)/\s*\d+\]\tTime\s+([\d.]+)", re.M)
LOADER_LINE = re.compile(r"^loader-only: (\{.*\})$", re.M)


@dataclass
class Job:
    name: str
    script: Path
    cwd: Path
    devices: int
    mode: str
    seed: int | None
    alone: bool
    data_dir: Path | None = None
    args: list[str] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    rc: int | None = None
    wall_s: float | None = None
    port: int | None = None  # ddp: the script's --dist-url port

    @property
    def global_batch(self) -> int:
        """Images per step over all processes: the script's -b, times N under per-gpu."""
        batch = int(self.args[self.args.index("-b") + 1])
        return batch * self.devices if self.mode == "per-gpu" else batch


def blob_id(path: Path) -> str:
    body = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(body) + body).hexdigest()


def check_scripts(pins: dict, folder: Path) -> dict:
    out = {}
    for name, (rel, blob) in pins.items():
        path = folder / rel
        found = blob_id(path) if path.is_file() else None
        out[name] = {"path": str(path), "pinned_blob": blob, "blob": found,
                     "unmodified": found == blob}
    return out


def command(job: Job, cpu: bool) -> list[str]:
    if job.mode == "1gpu":
        return [sys.executable, str(job.script), *job.args]
    if job.mode == "loader":
        return [sys.executable, str(LOADER), *job.args]
    if job.mode == "ddp":  # the script's own: one process per visible GPU, rank 0 of 1 node
        return [sys.executable, str(job.script), *job.args, "--multiprocessing-distributed",
                "--world-size", "1", "--rank", "0", "--dist-url", f"tcp://127.0.0.1:{job.port}",
                "--dist-backend", "gloo" if cpu else "nccl"]
    spec = f"cpu:{job.devices}" if cpu else str(job.devices)
    batch = ["--auto-batch", "per-gpu"] if job.mode == "per-gpu" else []
    return [sys.executable, "-m", "multigpu", "run", "--auto", *batch, "--devices", spec,
            "--min-free-memory", "0", "--log-dir", str(job.cwd / "ranklogs"),
            str(job.script), *job.args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(job: Job, cpu: bool, repo: Path, extra: dict | None = None) -> dict:
    env = dict(os.environ) | FIXED_ENV | (extra or {})
    env["PYTHONPATH"] = os.pathsep.join(
        [str(RECORDER), str(repo / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["AUTO_PUBLIC_RECORD"] = str(job.cwd / "record")
    env["AUTO_PUBLIC_CIFAR_NO_MD5"] = "1"
    env["MULTIGPU_LEASE_DIR"] = str(job.cwd / "leases")
    env["CUDA_VISIBLE_DEVICES"] = "" if cpu else ",".join(map(str, job.gpus))
    if not cpu and job.mode in ("auto", "per-gpu", "ddp"):
        env |= NCCL_TRACE
    return env


def start(job: Job, cpu: bool, repo: Path, extra: dict | None = None) -> subprocess.Popen:
    for sub in ("record", "leases"):
        (job.cwd / sub).mkdir(parents=True, exist_ok=True)
    if job.mode == "ddp":
        job.port = free_port()
    log = open(job.cwd.parent / f"{job.cwd.name}.log", "w")
    log.write(f"$ cd {job.cwd} && CUDA_VISIBLE_DEVICES={','.join(map(str, job.gpus))} "
              f"{' '.join(command(job, cpu))}\n")
    log.flush()
    print(f"[start] {job.name} {job.cwd.name} gpus={job.gpus}", flush=True)
    return subprocess.Popen(command(job, cpu), cwd=job.cwd, env=environment(job, cpu, repo, extra),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_all(jobs: list[Job], *, cpu: bool, slots: int, timeout: int, repo: Path,
            extra: dict | None = None) -> None:
    """Starts each job when its GPUs have a free slot (an `alone` job: the whole machine)."""
    gpus = 1 if cpu else _gpu_count()
    slots = 1 if cpu else slots
    free = {g: slots for g in range(gpus)}
    pending, running = list(jobs), []
    while pending or running:
        for job in list(pending):
            whole = all(v == slots for v in free.values())
            if job.alone and not whole:
                break  # wait for the machine to empty
            if any(j.alone for j, _, _ in running):
                break
            have = sorted((g for g in free if free[g] > 0), key=lambda g: (-free[g], g))
            if len(have) < (1 if cpu else job.devices):
                continue
            job.gpus = [] if cpu else sorted(have[:job.devices])
            for g in (job.gpus or [0]):
                free[g] -= slots if job.alone else 1
            running.append((job, start(job, cpu, repo, extra), time.perf_counter()))
            pending.remove(job)
        time.sleep(0.2)
        for item in list(running):
            job, proc, began = item
            if proc.poll() is None and time.perf_counter() - began < timeout:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, 9)  # the run's whole session: the launcher and its ranks
                proc.wait()
            job.rc, job.wall_s = proc.returncode, round(time.perf_counter() - began, 1)
            for g in (job.gpus or [0]):
                free[g] += slots if job.alone else 1
            running.remove(item)
            print(f"[done] {job.name} {job.cwd.name} rc={job.rc} {job.wall_s} s", flush=True)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def samples(record: Path) -> dict:
    """Per training pass (records made with grad on): over all ranks, how many indices were
    fetched, how many distinct, missing and repeated, and whether every rank's pass ended."""
    passes = collections.defaultdict(list)
    for f in sorted(record.glob("samples-rank*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r["grad"]:
                passes[(r["dataset"], r["pass"])].append(r)
    out = []
    for (dataset, n), recs in sorted(passes.items()):
        counts = collections.Counter(i for r in recs for i in r["indices"])
        size = recs[0]["len"]
        total = sum(counts.values())
        out.append({"dataset": dataset, "epoch": n, "len": size, "fetched": total,
                    "ranks": len(recs), "missing": size - len(counts),
                    "repeated": total - len(counts), "complete": all(r["complete"] for r in recs)})
    return {"passes": out, "once_per_epoch": bool(out) and all(
        p["missing"] == 0 and p["repeated"] == 0 and p["complete"] for p in out)}


def throughput(text: str, batch: int, warmup: int, printers: int = 1) -> dict | None:
    """images/s from the script's own printed batch times, the first `warmup` batches of each
    epoch not timed: rank 0's under --auto; in ddp mode every rank's (`printers`: each process
    prints; they step together, so their times agree). seconds_timed: the time those batches
    took, which should be 10 s or more for a steady mean."""
    times = [float(t) for i, t in BATCH_TIME.findall(text) if int(i) > warmup]
    if not times:
        return None
    mean = statistics.fmean(times)
    return {"batches_timed": len(times) // printers, "mean_batch_s": round(mean, 5),
            "seconds_timed": round(sum(times) / printers, 1),
            "images_per_s": round(batch / mean, 1)}


def loader_throughput(text: str) -> dict | None:
    """What auto_public_loader.py printed last."""
    found = LOADER_LINE.findall(text)
    return json.loads(found[-1]) if found else None


def collect(job: Job, expected: list[str], warmup: int) -> dict:
    text = (job.cwd.parent / f"{job.cwd.name}.log").read_text(errors="replace")
    regex, read = ACCURACY[job.name]
    found = re.findall(regex, text, re.M)
    saved = sorted(str(p.relative_to(job.cwd)) for p in job.cwd.rglob("*") if p.is_file()
                   and p.relative_to(job.cwd).parts[0] not in ("record", "leases", "ranklogs"))
    out = {"script": job.name, "run": job.cwd.name, "mode": job.mode, "devices": job.devices,
           "gpus": job.gpus, "seed": job.seed, "rc": job.rc, "wall_s": job.wall_s,
           "args": job.args, "accuracy": round(read(found[-1] if isinstance(found[-1], tuple)
                                                    else (found[-1],)), 3) if found else None,
           "saved": saved,
           "saved_once": sorted(saved) == sorted([] if job.mode == "loader" else expected),
           "samples": samples(job.cwd / "record"),
           "log": str(job.cwd.parent / f"{job.cwd.name}.log")}
    if job.mode in ("auto", "per-gpu", "ddp"):
        out["nccl_transports"] = dict(collections.Counter(TRANSPORT.findall(text)))
    if job.mode == "loader":
        out["throughput"] = loader_throughput(text)
    elif job.name == "imagenet":
        out["throughput"] = throughput(text, job.global_batch, warmup,
                                       job.devices if job.mode == "ddp" else 1)
    return out
