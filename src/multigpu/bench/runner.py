"""The parent process of `multigpu bench`: plan, launch each group, collect, report.

It never touches CUDA itself (a CUDA context here would take memory on GPU 0 before the workers
start); machine facts come from NVML (the device plan) and from the workers' first record.
Results are written after every launch, so a run cut short by a time limit keeps what it measured.
"""
from __future__ import annotations

import dataclasses
import json
import platform
import time
from importlib import metadata
from pathlib import Path

from multigpu.core import compiling, console
from multigpu.bench import realdata, report, stats, telemetry
from multigpu.bench.spec import (NUM_CLASSES, REAL_DECODE, BenchSettings, Group, Task, gpu_counts,
                                 plan_groups)
from multigpu.launcher.devices import DevicePlan, resolve_devices
from multigpu.core.errors import UsageError
from multigpu.core.system.extras import MissingExtra

MAX_ATTEMPTS = 3  # per group: after a failed task (see blamed()), the rest is started again
# Exit codes of a launch stopped because *we* got SIGINT/SIGTERM (Ctrl-C, `timeout`): stop there.
# A worker killed by another signal (137: SIGKILL from the OOM killer, 139: SIGSEGV) is a failed
# task; the rest of its group is started again.
STOPPED = (130, 143)


def resolve_out(out: str | None, label: str) -> Path:
    """The JSON path: --out FILE.json, --out DIR/ (a dated name inside), or benchmarks/results/."""
    name = f"{time.strftime('%Y-%m-%d')}-{label}.json"
    if out and out.endswith(".json"):
        path = Path(out)
        if path.exists():
            raise UsageError(f"--out {out} already exists; bench results are never overwritten: "
                             "choose another file, or give a folder to get a new dated name in it")
        return path
    folder = Path(out) if out else Path("benchmarks") / "results"
    path, n = folder / name, 2
    while path.exists():
        path, n = folder / name.replace(".json", f"-{n}.json"), n + 1
    return path


def group_plan(base: DevicePlan, group: Group) -> DevicePlan:
    if base.accelerator != "cuda":
        return DevicePlan("cpu", (), group.nproc)
    k = group.visible
    return dataclasses.replace(base, gpu_ids=base.gpu_ids[:k], nproc=group.nproc,
                               gpu_names=base.gpu_names[:k], tokens=base.tokens[:k])


def prepare_data(s: BenchSettings, counts: tuple[int, ...]) -> dict[str, tuple[str, int]]:
    """Data kind -> (Task.data, num_outputs) for each kind asked: ('synthetic', 1000), and
    ('folder:PATH', classes) with a JPEG folder big enough for one pass."""
    inputs = {}
    if "synthetic" in s.data:
        inputs["synthetic"] = ("synthetic", NUM_CLASSES)
    real = [k for k in s.data if k in REAL_DECODE]
    if real:
        folder, classes = _image_folder(s, counts)
        inputs.update({k: (f"folder:{folder}", classes) for k in real})
    return inputs


def _image_folder(s: BenchSettings, counts: tuple[int, ...]) -> tuple[Path, int]:
    """(folder, classes): --data folder:PATH's, or the cached JPEG folder, generated when missing
    (one image size, so one folder, for all)."""
    if s.folder:
        from multigpu.train.data.imagefolder import load_folder

        # Its layout checked here, in one line, not in every worker; the model's head its classes.
        return Path(s.folder).expanduser(), load_folder(s.folder, 224).num_outputs
    sizes = {s.image_size or _default_size(m) for m in s.models}
    if len(sizes) > 1:
        raise UsageError(f"--data real with models of different default image sizes ({sorted(sizes)}); "
                         "pass --image-size to use one size for all")
    need = realdata.images_needed(max(s.batch_sizes) * max(counts), s.warmup, s.steps, s.trials)
    start = time.perf_counter()
    folder = realdata.ensure_image_folder(s.data_dir, need, sizes.pop(), kind=s.images)
    console.info(f"multigpu bench: {need:,} generated {s.images} JPEG images in {folder} "
                 f"({time.perf_counter() - start:.1f} s, cached for the next run)")
    return folder, realdata.CLASSES


def _default_size(model: str) -> int:
    from multigpu.train.models.catalog import default_image_size

    return default_image_size(model)


def _versions() -> dict:
    from multigpu import __version__

    out = {"multigpu": __version__, "python": platform.python_version()}
    for dist in ("torch", "accelerate", "lightning", "torchvision"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def new_report(s: BenchSettings, plan: DevicePlan, counts: tuple[int, ...], label: str) -> dict:
    import os

    settings = {k: v for k, v in dataclasses.asdict(s).items() if k != "command"}
    flags = {"cudnn.benchmark": True, "tf32": True} if plan.accelerator == "cuda" else {}
    settings |= {"gpus": list(counts), "models": list(s.models), "batch_sizes": list(s.batch_sizes),
                 "methods": list(s.methods), "data": list(s.data),
                 "backend_flags": flags}  # set in worker.py
    return {"schema": report.SCHEMA, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": s.command,
            "machine": {"label": label, "hostname": platform.node(), "accelerator": plan.accelerator,
                        "gpu_name": plan.gpu_names[0] if plan.gpu_names else None,
                        "gpu_count": len(plan.gpu_ids), "cpus": os.cpu_count()},
            "versions": _versions(), "settings": settings, "rows": [], "skipped": [], "notes": [],
            "gpu_notes": [], "launches": []}


def read_records(folder: Path) -> tuple[dict[str, list[dict]], dict | None]:
    """Every rank's task records by key, and the first meta record (begin records: blamed())."""
    by_key: dict[str, list[dict]] = {}
    meta = None
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "meta":
                meta = meta or rec
            elif rec.get("kind") == "task":
                by_key.setdefault(rec["key"], []).append(rec)
    return by_key, meta


def last_begun(folder: Path) -> list[dict]:
    """Each rank's last begin record (worker.py writes one before each build and before a set's
    interleaved trials): what that rank was doing when the launch ended."""
    last = []
    for path in sorted(folder.glob("rank*.jsonl")):
        begins = [rec for rec in map(json.loads, path.read_text().splitlines())
                  if rec.get("kind") == "begin"]
        last += begins[-1:]
    return last


def blamed(folder: Path, remaining: list[Task]) -> tuple[Task, dict | None]:
    """The task a failed launch is blamed on, and the begin record that names it (None: no rank
    had begun an unfinished task, e.g. a crash at start-up; then the first task, as before
    interleaving). Ranks move through the tasks together (their collectives line up), so they
    normally agree; where they do not, the earliest unfinished task in job order is taken. A
    failure in a set's interleaved trials names the set's first task and the begin record lists
    the whole set, which run_group then drops."""
    order = {t.key: i for i, t in enumerate(remaining)}
    begun = [rec for rec in last_begun(folder) if rec["key"] in order]
    if not begun:
        return remaining[0], None
    rec = min(begun, key=lambda r: order[r["key"]])
    return remaining[order[rec["key"]]], rec


def _failure_note(task: Task, begin: dict | None, rc: int, folder: Path) -> str:
    if begin and begin.get("phase") == "trials":
        n = len(begin["keys"])
        return (f"{task.describe()} and the {n - 1} other method(s) timed in turns with it failed "
                f"(exit code {rc}) in their interleaved trials; that set is not measured (all its "
                f"methods are resident at once: try fewer --methods); every rank's logs in "
                f"{folder / 'logs'}")
    return (f"{task.describe()} failed (exit code {rc}); traceback printed above, every "
            f"rank's logs in {folder / 'logs'}")


@dataclasses.dataclass
class Collected:
    records: dict[str, list[dict]] = dataclasses.field(default_factory=dict)  # task key -> ranks
    meta: dict | None = None  # the first worker's facts: versions, GPU name, hostname


def run_group(index: int, group: Group, plan: DevicePlan, work: Path, rep: dict,
              got_all: Collected, save) -> bool:
    """Launch the group's tasks; on a failure, note it and start the rest again. False = stop.
    `save()` is called after every launch, so the JSON always holds every finished task."""
    from multigpu.launcher.launch import LaunchOptions, launch

    remaining = list(group.tasks)
    for attempt in range(MAX_ATTEMPTS):
        folder = (work / f"launch{index}-{attempt}").resolve()
        folder.mkdir(parents=True, exist_ok=True)
        job = {"accelerator": plan.accelerator, "results_dir": str(folder),
               "tasks": [dataclasses.asdict(t) for t in remaining]}
        (folder / "job.json").write_text(json.dumps(job, indent=1))
        console.info(f"multigpu bench: launch {index + 1}: {group.describe()}")
        rc = launch(["-m", "multigpu.bench.worker", str(folder / "job.json")], group_plan(plan, group),
                    LaunchOptions(log_dir=str(folder / "logs")))
        got, meta = read_records(folder)
        got_all.meta = got_all.meta or meta
        for t in remaining:
            if len(got.get(t.key, [])) == group.nproc:
                got_all.records[t.key] = got[t.key]
        remaining = [t for t in remaining if t.key not in got_all.records]
        rep["launches"].append({"group": group.describe(), "attempt": attempt, "exit_code": rc,
                                "logs": str(folder)})
        save()
        if rc in STOPPED:
            rep["notes"].append(f"stopped by a signal during launch {index + 1}; "
                                f"{len(remaining)} task(s) not measured")
            return False
        if not remaining:
            if rc != 0:  # e.g. a crash while tearing down the process group
                rep["notes"].append(f"launch {index + 1} exited with code {rc} after all its "
                                    f"tasks finished; logs in {folder / 'logs'}")
            return True
        failed, begin = blamed(folder, remaining)
        lost = {failed.key}
        if begin and begin.get("phase") == "trials":  # the set failed as a whole: e.g. out of
            lost |= set(begin["keys"])  # memory with every method resident; retrying it would
        remaining = [t for t in remaining if t.key not in lost]  # use up the group's attempts
        rep["notes"].append(_failure_note(failed, begin, rc, folder))
    if remaining:
        rep["notes"].append(f"gave up on {len(remaining)} task(s) of launch {index + 1} after "
                            f"{MAX_ATTEMPTS} failed attempts")
    return True


def finish(rep: dict, groups: list[Group], got: Collected, flops: dict, path: Path) -> None:
    """Rows from the records so far, machine facts from the workers, then the JSON."""
    if got.meta:
        rep["versions"] |= {k: got.meta.get(k) for k in ("torch", "cuda", "nccl", "cudnn")}
        rep["machine"]["gpu_name"] = rep["machine"]["gpu_name"] or got.meta.get("gpu_name")
    rows = [report.build_row(t, got.records[t.key], flops.get(report.flops_key(t)))
            for g in groups for t in g.tasks if t.key in got.records]
    report.add_scaling(rows)
    report.add_of_synthetic(rows)
    rep["rows"] = rows
    rep["gpu_notes"] = telemetry.slowdown_notes(rows)  # recomputed at every save, not appended
    report.write_json(rep, path)


def run(s: BenchSettings) -> dict:
    plan = resolve_devices(s.devices, one_process=False, min_free_memory_gb=s.min_free_memory)
    compiling.check(s.compile, plan.accelerator, "ddp")  # e.g. reduce-overhead where "auto" found no GPU
    if s.compile:  # the workers compile from a cache that outlives /tmp, as multigpu train's do
        compiling.use_persistent_cache()
    if plan.accelerator == "cuda":
        counts = gpu_counts(s.gpus, len(plan.gpu_ids), "GPUs", f"--devices {s.devices}")
    else:
        hint = f"{plan.note or '--devices ' + s.devices}; --devices cpu:N gives N CPU processes"
        counts = gpu_counts(s.gpus, plan.nproc, "CPU processes", hint)
    label = report.machine_label(plan.accelerator, len(plan.gpu_ids) or plan.nproc,
                                 plan.gpu_names[0] if plan.gpu_names else None)
    path = resolve_out(s.out, label)
    groups, skipped = plan_groups(s, plan.accelerator, counts, prepare_data(s, counts))
    rep = new_report(s, plan, counts, label)
    rep["skipped"] = skipped
    if not groups:
        raise UsageError("nothing to measure: " + "; ".join(
            f"{note['method']}: {note['reason']}" for note in skipped))
    for note in skipped:
        console.info(f"multigpu bench: skipping {note['method']}: {note['reason']}")
    flops = count_flops([t for g in groups for t in g.tasks])
    console.info(f"multigpu bench: {sum(len(g.tasks) for g in groups)} measurements in "
                 f"{len(groups)} launches; results -> {path}")
    got = Collected()
    work = path.with_name(f"{path.stem}-logs")
    def save() -> None:
        finish(rep, groups, got, flops, path)

    try:
        for i, group in enumerate(groups):
            if not run_group(i, group, plan, work, rep, got, save):
                break
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (a time limit) between two launches
        rep["notes"].append("interrupted; the rows measured so far are kept")
    planned = sum(len(g.tasks) for g in groups)
    if len(got.records) < planned:
        missing = planned - len(got.records)
        rep["notes"].append(f"{missing} of {planned} planned measurements are missing")
    png = _plot(rep, path.with_suffix(".png"))
    save()
    return rep | {"json": str(path), "png": png}


def count_flops(tasks) -> dict:
    """FLOPs of one GPU's step for every task, counted once per model and image size at batch 2
    (matmuls and convolutions grow linearly with the batch; 2 keeps BatchNorm happy)."""
    per_sample: dict[tuple, float | None] = {}
    out = {}
    for t in tasks:
        shape = (t.model, t.image_size, t.num_outputs)
        if shape not in per_sample:  # on the meta device: shapes only, a second or two per model
            two = stats.train_step_flops(t.model, (3, t.image_size, t.image_size), t.num_outputs, 2)
            per_sample[shape] = two / 2 if two else None
        f = per_sample[shape]
        out[report.flops_key(t)] = round(f * t.batch_size) if f else None
    return out


def _plot(rep: dict, path: Path) -> str | None:
    try:
        return str(report.plot(rep, path))
    except Exception as exc:  # the measurements matter more than the picture: keep the JSON
        missing = isinstance(exc, MissingExtra)  # a message of its own, with the fix
        rep["notes"].append(f"no plot: {exc}" if missing else f"no plot: {type(exc).__name__}: {exc}")
        return None
