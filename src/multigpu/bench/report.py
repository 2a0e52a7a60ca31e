"""Rows from the workers' records, and the three outputs: a rich table, a JSON file, a PNG plot.

JSON layout (SCHEMA below), one file per invocation:
    schema, date, command, machine {label, hostname, accelerator, gpu_name, gpu_count, cpus},
    versions {multigpu, torch, cuda, nccl, cudnn, python, accelerate, lightning},
    settings {every flag, plus the global backend flags the workers set},
    rows [ one per (method, model, batch size, GPU count, data kind): see ROW_KEYS ],
    skipped [ {method, reason} ], notes [ str ], launches [ {group, attempt, exit_code, logs} ]
"""
from __future__ import annotations

import json
from pathlib import Path

from multigpu.core.system import fileio
from multigpu.bench import stats, telemetry
from multigpu.bench.spec import REAL_DECODE, Task, base_method

SCHEMA = "multigpu-bench/1"
STEADY_STATE_NOTE = ("real data: timed in the input pipeline's steady state: the batches the loader "
                     "queued during the warm-up were taken off unused, and as many steps run again, "
                     "before the first timed step (realdata.loader_prepared)")
GIB = 1024**3
ROW_KEYS = (
    "method", "variant", "model", "batch_size", "gpus", "processes", "global_batch", "image_size",
    "num_outputs", "data", "precision", "compile",
    "steps", "warmup", "trials", "interleaved", "trial_seconds", "img_per_s", "img_per_s_min",
    "img_per_s_max", "spread_pct", "step_ms", "step_ms_min", "step_ms_max", "scaling_efficiency",
    "of_synthetic", "peak_memory_gib", "memory_before_gib", "memory_held_by_others_gib",
    "flops_per_step_per_gpu", "mfu", "gpu_name", "strategy", "wrapper", "optimizer",
    "setup_seconds", "trial_gpu",
)
# variant: the DDP variant of a multigpu-ddp:<variant> row (spec.DDP_VARIANTS), else None.
# interleaved: how many methods, this one included, took turns trial by trial (1: alone).
# trial_gpu: per trial, the GPUs' SM clock, power, temperature and clock-event reasons over every
# rank (telemetry.merge_ranks); None on CPU or without NVML.
# peak_memory_gib: the whole device's peak during this method's own steps, so with interleaving it
# includes what the other live methods hold: memory_held_by_others_gib (see measure.Run).


def machine_label(accelerator: str, count: int, gpu_name: str | None) -> str:
    """'4xH200' from 4 x 'NVIDIA H200'; '2xCPU' for CPU processes."""
    if accelerator != "cuda" or not gpu_name:
        return f"{count}xCPU"
    words = gpu_name.replace("NVIDIA", "").replace("-", " ").split()
    return f"{count}x{words[0] if words else 'GPU'}"


def flops_key(task: Task) -> tuple:
    return task.model, task.image_size, task.num_outputs, task.batch_size


def build_row(task: Task, ranks: list[dict], flops: int | None) -> dict:
    """One row from every rank's record of a task: the slowest rank's time for each trial."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    seconds = [max(r["seconds"][i] for r in ranks) for i in range(task.trials)]
    first = ranks[0]
    samples = first["samples"]
    row = {"method": task.method, "variant": task.variant, "model": task.model, "batch_size": task.batch_size,
           "gpus": task.gpus, "processes": first.get("world_size", len(ranks)),
           "global_batch": samples[0] // task.steps, "image_size": task.image_size,
           "num_outputs": task.num_outputs, "data": task.data_kind,
           "precision": first.get("precision"), "compile": task.compile, "steps": task.steps,
           "warmup": first.get("warmup", task.warmup),
           "trials": task.trials, "interleaved": first.get("interleaved", 1),
           "trial_seconds": seconds}
    row |= stats.trial_stats(seconds, samples, task.steps)
    peaks = [m for r in ranks for m in (r.get("peak_memory") or [])]
    before = [m for r in ranks for m in (r.get("memory_before") or [])]
    others = [m for r in ranks for m in (r.get("memory_held_by_others") or [])]
    gpu_name = (first.get("device_names") or [None])[0]
    row |= {"scaling_efficiency": None, "of_synthetic": None,
            "peak_memory_gib": [round(m / GIB, 3) for m in peaks] or None,
            "memory_before_gib": [round(m / GIB, 3) for m in before] or None,
            "memory_held_by_others_gib": [round(m / GIB, 3) for m in others] or None,
            "flops_per_step_per_gpu": flops,
            "mfu": stats.mfu(flops, row["step_ms"] / 1000,
                             stats.peak_flops(gpu_name, row["precision"])),
            "gpu_name": gpu_name, "strategy": first.get("strategy"), "wrapper": first.get("wrapper"),
            "optimizer": first.get("optimizer"), "setup_seconds": round(first["setup_seconds"], 2),
            "trial_gpu": telemetry.merge_ranks([r.get("gpu_trials") for r in ranks], task.trials)}
    return row


def add_scaling(rows: list[dict]) -> None:
    """Efficiency against the multigpu-single row of the same model, batch and data."""
    def same(r: dict) -> tuple:
        return r["model"], r["batch_size"], r["image_size"], r["data"]

    single = {same(r): r["img_per_s"] for r in rows if r["method"] == "multigpu-single"}
    for r in rows:
        base = single.get(same(r))
        r["scaling_efficiency"] = stats.scaling_efficiency(r["img_per_s"], r["gpus"], base)


def add_of_synthetic(rows: list[dict]) -> None:
    """Real-data img/s as a share of the synthetic row of the same method, model, batch, image size
    and GPU count: what the input pipeline costs, measured in one run (None without that row)."""
    def same(r: dict) -> tuple:
        return r["method"], r["model"], r["batch_size"], r["image_size"], r["gpus"]

    synthetic = {same(r): r["img_per_s"] for r in rows if r["data"] == "synthetic"}
    for r in rows:
        base = synthetic.get(same(r)) if r["data"] in REAL_DECODE else None
        r["of_synthetic"] = r["img_per_s"] / base if base else None


def write_json(report: dict, path: Path) -> None:
    """Atomically: a reader (or a time limit) never sees half a file."""
    fileio.atomic_write_text(path, json.dumps(report, indent=2) + "\n")


# --------------------------------------------------------------------------- console table

def compile_label(mode) -> str:
    """What a row's method gets in the table: ' +compile' in torch's default mode, ' +compile:MODE'
    in another, nothing when not compiled (JSON written before modes existed holds True/False)."""
    if not mode:
        return ""
    return " +compile" if mode in (True, "default") else f" +compile:{mode}"


def _fmt(value, spec: str, empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def data_kinds(report: dict) -> list[str]:
    """The data kinds the run asked for (a plain string in reports written before the list)."""
    data = report["settings"]["data"]
    return [data] if isinstance(data, str) else list(data)


def data_title(report: dict) -> str:
    """'synthetic and real data', with the folder the real kinds read when it was the user's."""
    folder = report["settings"].get("folder")
    return f"{' and '.join(data_kinds(report))} data" + (f" (real: {folder})" if folder else "")


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from multigpu.core.console import console as shared

    # Our own console: a log file or pipe gets 140 columns instead of rich's default 80.
    console = Console(highlight=False, width=None if shared.is_terminal else 140)

    m = report["machine"]
    kinds = data_kinds(report)
    table = Table(title=f"multigpu bench on {m['label']} ({m.get('gpu_name') or 'CPU'}), "
                        f"{data_title(report)}", title_justify="left")
    unit = "GPUs" if m["accelerator"] == "cuda" else "procs"
    mixed = len(kinds) > 1  # a data column, and a share of synthetic where a real row has one
    share = any(r.get("of_synthetic") is not None for r in report["rows"])
    names = ("method", "model", *(["data"] if mixed else []), "batch", unit, "img/s", "min-max",
             "step ms", "scaling", *(["of synth."] if share else []), "peak GiB", "MFU")
    for name in names:
        table.add_column(name, justify="left" if name in ("method", "model", "data") else "right")
    for r in report["rows"]:
        mem = r["peak_memory_gib"]
        table.add_row(
            r["method"] + compile_label(r.get("compile")), r["model"],
            *([r["data"]] if mixed else []), str(r["batch_size"]), str(r["gpus"]),
            f"{r['img_per_s']:,.0f}", f"{r['img_per_s_min']:,.0f}-{r['img_per_s_max']:,.0f}",
            f"{r['step_ms']:.1f}", _fmt(r["scaling_efficiency"], ".0%"),
            *([_fmt(r.get("of_synthetic"), ".0%")] if share else []),
            f"{max(mem):.1f}" if mem else "-", _fmt(r["mfu"], ".1%"))
    console.print(table)
    if any(r.get("interleaved", 1) > 1 for r in report["rows"]):
        console.print("trials interleaved: methods with the same model, batch, data and GPU count "
                      "took turns, trial by trial; their peak GiB includes what the others held",
                      markup=False)
    if any(r["data"] in REAL_DECODE for r in report["rows"]):
        console.print(STEADY_STATE_NOTE, markup=False)
    for s in report["skipped"]:
        console.print(f"skipped {s['method']}: {s['reason']}", markup=False)
    for note in report["notes"] + report.get("gpu_notes", []):
        console.print(f"note: {note}", markup=False)


# --------------------------------------------------------------------------- plot

def _series(rows: list[dict]) -> dict[str, list[tuple[int, float, float | None]]]:
    """label -> [(gpus, img/s, efficiency)]; the DDP/DP lines start from the single-GPU point
    (see _starting_at_single)."""
    combos = {(r["model"], r["batch_size"]) for r in rows}
    mixed = len({r["data"] for r in rows}) > 1

    def label(method: str, r: dict) -> str:
        text = method if len(combos) == 1 else f"{method} {r['model']} b{r['batch_size']}"
        if mixed and r["data"] in REAL_DECODE:  # real and synthetic apart
            return f"{text} {r['data']}"
        return text

    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(label(r["method"], r), []).append(
            (r["gpus"], r["img_per_s"], r["scaling_efficiency"]))
        if r["method"] == "multigpu-single":
            for method in _starting_at_single(r, rows):
                out.setdefault(label(method, r), []).append(
                    (1, r["img_per_s"], r["scaling_efficiency"]))
    return {k: sorted(set(v)) for k, v in out.items()}


def _starting_at_single(single: dict, rows: list[dict]) -> list[str]:
    """The methods whose line starts from this multigpu-single row: at one GPU multigpu-ddp and
    multigpu-dp are the single-GPU step, and so is every multigpu-ddp:<variant> (its knobs act on
    the all-reduce, which one GPU does not do)."""
    return list(dict.fromkeys(
        x["method"] for x in rows
        if base_method(x["method"]) in ("multigpu-ddp", "multigpu-dp")
        and (x["model"], x["batch_size"], x["data"]) == (single["model"], single["batch_size"],
                                                          single["data"])))


def is_batch_sweep(rows: list[dict]) -> bool:
    """Several batch sizes of one model and data kind at one multi-GPU count: plotted against the
    batch size, one line per method (against the GPU count, it would be a cloud of dots)."""
    many = {r["gpus"] for r in rows if r["gpus"] > 1}
    return (len(many) == 1 and len({r["batch_size"] for r in rows}) > 1
            and len({(r["model"], r["data"]) for r in rows}) == 1)


def _plot_batch_sweep(rows: list[dict], left, right) -> None:
    n = max(r["gpus"] for r in rows)
    batches = sorted({r["batch_size"] for r in rows})
    for method in dict.fromkeys(r["method"] for r in rows):
        # Only the sweep's GPU count (peers also have 1-GPU rows), and the reference.
        mine = sorted(((r["batch_size"], r) for r in rows if r["method"] == method
                       and (r["gpus"] == n or method == "multigpu-single")), key=lambda t: t[0])
        if not mine:
            continue
        xs = [b for b, _ in mine]
        if method == "multigpu-single":  # the reference: N x one GPU, the ideal
            left.plot(xs, [n * r["img_per_s"] for _, r in mine], ls=":", color="grey",
                      label=f"{n} x multigpu-single (linear)")
            continue
        left.plot(xs, [r["img_per_s"] for _, r in mine], marker="o", label=f"{method} x{n}")
        eff = [(b, r["scaling_efficiency"]) for b, r in mine if r["scaling_efficiency"] is not None]
        right.plot([b for b, _ in eff], [100 * e for _, e in eff], marker="o", label=f"{method} x{n}")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])


def plot(report: dict, path: Path) -> Path:
    """Two panels: throughput (with ideal linear scaling) and efficiency, against the GPU count,
    or against the batch size for a batch sweep at one GPU count."""
    from multigpu.core.system.extras import require

    matplotlib = require("matplotlib", "the benchmark plot", extra="bench")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    m = report["machine"]
    unit = "GPUs" if m["accelerator"] == "cuda" else "CPU processes"
    if is_batch_sweep(rows):
        _plot_batch_sweep(rows, left, right)
        right.axhline(100, ls=":", color="grey", lw=1)
        left.set(title=f"throughput ({m['label']}, dotted: linear)", xlabel="batch per GPU",
                 ylabel="images/s")
        right.set(title="scaling efficiency vs multigpu-single", xlabel="batch per GPU",
                  ylabel="% of linear")
        for ax in (left, right):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        return _finish_plot(fig, plt, report, path)
    for label, points in _series(rows).items():
        xs = [p[0] for p in points]
        single = label.startswith("multigpu-single")  # one point: drawn on top, as a star
        left.plot(xs, [p[1] for p in points], marker="*" if single else "o",
                  ms=12 if single else 6, zorder=5 if single else 2, label=label)
        eff = [(p[0], p[2]) for p in points if p[2] is not None]
        if eff:
            right.plot([e[0] for e in eff], [100 * e[1] for e in eff], marker="o", label=label)
    counts = sorted({r["gpus"] for r in rows}) or [1]
    for r in rows:
        if r["method"] == "multigpu-single" and len(counts) > 1:
            left.plot(counts, [n * r["img_per_s"] for n in counts], ls=":", color="grey", lw=1)
    right.axhline(100, ls=":", color="grey", lw=1)
    left.set(title=f"throughput ({m['label']}, dotted: linear)", xlabel=unit, ylabel="images/s")
    right.set(title="scaling efficiency vs multigpu-single", xlabel=unit, ylabel="% of linear")
    for ax in (left, right):
        ax.set_xticks(counts)
        ax.grid(alpha=0.3)
    if rows:
        left.legend(fontsize=8)
    return _finish_plot(fig, plt, report, path)


def _finish_plot(fig, plt, report: dict, path: Path) -> Path:
    settings = report["settings"]
    mode = settings.get("compile")
    compiled = f", multigpu methods compiled ({'default' if mode is True else mode})" if mode else ""
    fig.suptitle(f"multigpu bench, {report['date']}: {', '.join(settings['models'])}, "
                 f"batch {','.join(map(str, settings['batch_sizes']))} per GPU, "
                 f"{data_title(report)}{compiled}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
