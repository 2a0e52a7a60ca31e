"""A sweep's results: DIR/summary.csv, summary.md and summary.png, one row (or cell) per run.

Runs are ranked by the best value of the metric over their epochs: lowest first, unless the
name has "acc" in it (val_accuracy) or ends in ":max" (":min" says lowest explicitly). Runs
without a value (failed, pending) follow in grid order, with an empty rank.

    summary.csv   rank, name, one column per grid key, status, attempts, duration_s,
                  final_<metric>, best_<metric>, note (the numbers unrounded, for pandas)
    summary.md    the same table to read, with the counts: "9 of 18 runs done, 1 failed"
    summary.png   the best value of each run, laid out on the grid:
                    one key varies     a line against it
                    two keys vary      a heat map, the first key down, the second across
                    three or more      one heat map per value of the keys before the last two
                                       (post 002: one per dataset, history length against
                                       forecast length); past 12 panels, a line per value of
                                       the first key against the last one instead

A key is numeric when every run's value converts with float() ("40" from the command line as
well as 40): its values go in numeric order, on a numeric axis for the line. Otherwise they
keep the order the runs give them. Each heat map has its own colour scale (panels are usually
other datasets, in other units: post 002's CO2 errors are in ppmv, its macro errors in
billions), and the colour map is reversed for lower-is-better, so the better end always has the
same colour. Failed runs have
no cell. Every file is written whole or not at all (fileio); the PNG needs the `plot` extra and
is skipped without it, since the table already says everything.
"""
from __future__ import annotations

import difflib
import io
import itertools
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from multigpu.core.system import fileio
from multigpu.core.system.extras import MissingExtra, require
from multigpu.sweep.state import format_duration

SUMMARY_CSV, SUMMARY_MD, SUMMARY_PNG = "summary.csv", "summary.md", "summary.png"
MAX_PANELS = 12
ABSENT = "-"  # the value of a key that a run's grid does not give (a list of grids)


@dataclass
class RunResult:
    name: str                  # folder-safe run name, e.g. "data=timeseries-co2,seq_length=40"
    params: dict[str, object]  # the grid values of this run, in grid order
    status: str                # "done" | "failed" | "running" | "pending" | "stopped"
    duration_s: float | None   # wall time of the last attempt (None when it never ran)
    final: float | None        # the metric's value in the last epoch record that has it
    best: float | None         # the best value over the epochs
    attempts: int = 0
    note: str = ""             # e.g. why it failed: "exit 1: RuntimeError: ..." (one line)


def split_metric(metric: str) -> tuple[str, bool]:
    """(name, higher_is_better): ("val_mae", False) from "val_mae"; ":max" / ":min" win."""
    name, _, way = metric.rpartition(":")
    if name and way in ("max", "min"):
        return name, way == "max"
    return metric, "acc" in metric.lower()


def metric_direction(metric: str) -> bool:
    """True when higher values of `metric` are better (accuracy), False for losses and errors."""
    return split_metric(metric)[1]


def metric_values(records: list[dict], metric: str) -> tuple[float | None, float | None]:
    """(last value, best value) of `metric` over a run's epoch records (metrics.jsonl), skipping
    records without it or with a non-finite value; (None, None) when no record has one."""
    name, higher = split_metric(metric)
    values = [v for v in (_number(r.get(name)) for r in records) if v is not None]
    if not values:
        return None, None
    return values[-1], (max(values) if higher else min(values))


def absent_metric(records: list[dict], metric: str) -> str | None:
    """What a run that logged epochs, none with `metric`, logged instead: a misspelt --metric
    (val_acc) would otherwise leave every run unranked without a word."""
    name, _ = split_metric(metric)
    logged = sorted({k for r in records for k, v in r.items() if _number(v) is not None} - {"epoch"})
    if not logged or name in logged:
        return None
    close = difflib.get_close_matches(name, logged, n=1, cutoff=0.5)
    return (f"no {name} in its metrics.jsonl; "
            + (f"did you mean --metric {close[0]}?" if close else f"it logs {', '.join(logged)}"))


def sort_results(results: list[RunResult], higher_is_better: bool) -> list[RunResult]:
    """Best first; the runs without a value after them, in their given order."""
    scored = sorted((r for r in results if r.best is not None),
                    key=lambda r: -r.best if higher_is_better else r.best)
    return scored + [r for r in results if r.best is None]


def write_summary(folder: Path, results: list[RunResult], grid_keys: list[str], metric: str, *,
                  title: str = "") -> list[Path]:
    """Write summary.csv, summary.md and (with matplotlib, and a value to draw) summary.png into
    `folder`; return the paths written."""
    folder = Path(folder)
    name, higher = split_metric(metric)
    ranked = sort_results(results, higher)
    columns = ["rank", "name", *grid_keys, "status", "attempts", "duration_s",
               f"final_{name}", f"best_{name}", "note"]
    rows = [_csv_row(i + 1, r, grid_keys, name) for i, r in enumerate(ranked)]
    written = [fileio.atomic_write_csv(folder / SUMMARY_CSV, columns, rows),
               fileio.atomic_write_text(folder / SUMMARY_MD, _markdown(ranked, grid_keys, name, higher))]
    png = _draw(folder / SUMMARY_PNG, results, grid_keys, name, higher,
                title or f"{name}: best per run")
    return written + ([png] if png else [])


def _number(value: object) -> float | None:
    """`value` as a finite float, or None (booleans are not numbers here: a True/False key
    reads better as two categories than as 0 and 1)."""
    if isinstance(value, bool):
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _csv_row(rank: int, r: RunResult, keys: list[str], name: str) -> dict:
    return {"rank": rank if r.best is not None else "", "name": r.name,
            **{k: r.params.get(k, "") for k in keys}, "status": r.status, "attempts": r.attempts,
            "duration_s": "" if r.duration_s is None else round(r.duration_s, 1),
            f"final_{name}": "" if r.final is None else r.final,
            f"best_{name}": "" if r.best is None else r.best, "note": r.note}


def _markdown(ranked: list[RunResult], keys: list[str], name: str, higher: bool) -> str:
    counts = Counter(r.status for r in ranked)
    others = "".join(f", {counts[s]} {s}" for s in ("running", "pending", "stopped") if counts[s])
    header = ["rank", "name", *keys, "status", "attempts", "time", f"final {name}",
              f"best {name}", "note"]
    lines = [f"# Sweep results: best {name} per run ({'higher' if higher else 'lower'} is better)",
             "", f"{counts['done']} of {len(ranked)} runs done, {counts['failed']} failed{others}.",
             "", _md_row(header), "|" + "---|" * len(header)]
    for i, r in enumerate(ranked):
        note = r.note if len(r.note) <= 120 else r.note[:117] + "..."
        lines.append(_md_row([i + 1 if r.best is not None else "", r.name,
                              *(r.params.get(k, "") for k in keys), r.status, r.attempts,
                              format_duration(r.duration_s), _num(r.final), _num(r.best), note]))
    return "\n".join(lines) + "\n"


def _md_row(cells: list) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.4g}"


# --------------------------------------------------------------------------- the picture

@dataclass(frozen=True)
class _Axis:
    """One grid key's values among the drawn runs: numbers in numeric order when every value is
    one, else strings in the order the runs give them."""
    key: str
    values: tuple
    numeric: bool

    @classmethod
    def of(cls, results: list[RunResult], key: str) -> _Axis:
        raw = [r.params.get(key, ABSENT) for r in results]
        numbers = [_number(v) for v in raw]
        if all(n is not None for n in numbers):
            return cls(key, tuple(sorted(set(numbers))), True)
        return cls(key, tuple(dict.fromkeys(str(v) for v in raw)), False)

    def coord(self, r: RunResult) -> float | str:
        """Where run `r` sits on this axis ("40" and 40 are one place)."""
        v = r.params.get(self.key, ABSENT)
        return _number(v) if self.numeric else str(v)

    def label(self, v: float | str) -> str:
        return f"{v:g}" if self.numeric else v

    def labels(self) -> list[str]:
        return [self.label(v) for v in self.values]


def _best_cells(scored: list[RunResult], axes: list[_Axis], higher: bool) -> dict[tuple, float]:
    """The best value at each place on `axes`, over the runs that differ only in other keys."""
    cells: dict[tuple, float] = {}
    for r in scored:
        at = tuple(a.coord(r) for a in axes)
        if at not in cells or (r.best > cells[at] if higher else r.best < cells[at]):
            cells[at] = r.best
    return cells


def _draw(path: Path, results: list[RunResult], keys: list[str], name: str, higher: bool,
          title: str) -> Path | None:
    scored = [r for r in results if r.best is not None]  # in grid order: the categories' order
    if not scored:
        return None
    try:
        matplotlib = require("matplotlib", f"drawing {SUMMARY_PNG}")
    except MissingExtra:
        return None  # the tables hold everything; the picture comes with the plot extra
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = _figure(plt, scored, keys, name, higher)
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    fileio.atomic_write(path, lambda f: f.write(buf.getvalue()))  # a temp name, then renamed
    return path


def _figure(plt, scored: list[RunResult], keys: list[str], name: str, higher: bool):
    """The line, heat map or heat maps that fit the keys that vary among the drawn runs."""
    if not keys:  # runs from include entries only: one point per run, by name
        scored, keys = [replace(r, params={"run": r.name}) for r in scored], ["run"]
    axes = [_Axis.of(scored, k) for k in keys]
    varying = [a for a in axes if len(a.values) > 1] or axes[:1]
    if len(varying) == 1:
        return _lines(plt, scored, varying[0], None, name, higher)
    outer, x = varying[:-2], varying[-1]
    present = {tuple(a.coord(r) for a in outer) for r in scored}
    panels = [p for p in itertools.product(*(a.values for a in outer)) if p in present]
    if len(panels) > MAX_PANELS:
        return _lines(plt, scored, x, varying[0], name, higher)
    return _heatmaps(plt, scored, varying, panels, name, higher)


def _lines(plt, scored: list[RunResult], x: _Axis, by: _Axis | None, name: str, higher: bool):
    """Best value against `x`, one line per value of `by` (each point the best of the runs
    there, when other keys vary too)."""
    fig, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
    cells = _best_cells(scored, [by, x] if by else [x], higher)
    at = list(x.values) if x.numeric else list(range(len(x.values)))
    for g in (by.values if by else [None]):
        ys = [cells.get((g, v) if by else (v,), math.nan) for v in x.values]
        ax.plot(at, ys, marker="o", label=f"{by.key}={by.label(g)}" if by else None)
    if x.numeric and min(at) > 0 and max(at) >= 100 * min(at):
        ax.set_xscale("log")  # learning rates and the like: 1e-4 .. 1e-2 evenly spaced
        ax.minorticks_off()
    if len(at) <= 20:
        ax.set_xticks(at, x.labels())
    ax.set(xlabel=x.key, ylabel=f"best {name}")
    if by:
        ax.set_title(f"the best over the other keys, per {by.key} and {x.key}", fontsize=9)
        ax.legend(fontsize=8, ncol=2 if len(by.values) > 6 else 1)
    ax.grid(alpha=0.3)
    return fig


def _heatmaps(plt, scored: list[RunResult], varying: list[_Axis], panels: list[tuple], name: str,
              higher: bool):
    """One heat map per panel (a combination of the keys before the last two, `varying`'s y and
    x), each on its own colour scale."""
    import numpy as np

    outer, y, x = varying[:-2], varying[-2], varying[-1]
    cells = _best_cells(scored, [*outer, y, x], higher)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    width, height = max(3.5, 0.8 * len(x.values) + 2), max(3.0, 0.45 * len(y.values) + 2)
    fig, axs = plt.subplots(rows, cols, figsize=(width * cols + 1, height * rows),
                            layout="constrained", squeeze=False)
    used = list(axs.flat)[:len(panels)]
    cmap = "viridis" if higher else "viridis_r"  # the better end is yellow either way
    for ax, panel in zip(used, panels):
        members = [r for r in scored if tuple(a.coord(r) for a in outer) == panel]
        y, x = _Axis.of(members, y.key), _Axis.of(members, x.key)  # a panel's own values (post
        # 002's second dataset has lengths of its own)
        grid = np.array([[cells.get((*panel, yv, xv), np.nan) for xv in x.values]
                         for yv in y.values])  # NaN: no run there, drawn blank
        image = ax.imshow(grid, cmap=cmap, vmin=np.nanmin(grid), vmax=np.nanmax(grid), aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.4g}", ha="center", va="center", fontsize=8,
                        bbox={"facecolor": "white", "alpha": 0.6, "linewidth": 0, "pad": 1})
        ax.set_xticks(range(len(x.values)), x.labels())
        ax.set_yticks(range(len(y.values)), y.labels())
        ax.set(xlabel=x.key, ylabel=y.key)
        if outer:
            ax.set_title(", ".join(f"{a.key}={a.label(v)}" for a, v in zip(outer, panel)),
                         fontsize=9)
        fig.colorbar(image, ax=ax, label=f"best {name} ({'higher' if higher else 'lower'} is better)")
    for ax in list(axs.flat)[len(panels):]:
        ax.set_visible(False)
    return fig
