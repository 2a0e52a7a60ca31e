"""Pictures of training runs: curves.png at the end of each run, `multigpu plot RUN...` for several.

One figure, two panels, against the optimizer step (the x axis all logs share):
    loss        the training loss per logged step (thin, from steps.csv), the training and
                validation loss per epoch (markers, from metrics.jsonl)
    validation  accuracy in % (classification), or MAE and RMSE in the data's units (time series)
Each run has its own colour; the legend names the runs and the line styles.
matplotlib comes with the `plot` extra; without it, draw() raises MissingExtra (one line).
"""
from __future__ import annotations

import csv
from pathlib import Path

from multigpu.train.rundir import runfolder
from multigpu.core.system import fileio
from multigpu.core.errors import UsageError
from multigpu.core.system.extras import require
from multigpu.core.loggers import STEPS_CSV

CURVES = "curves.png"


def read_run(folder: Path) -> dict:
    """A run folder's epochs (metrics.jsonl) and logged steps (steps.csv), as lists of dicts."""
    folder = Path(folder)
    if not (folder / runfolder.METRICS).is_file():
        raise UsageError(f"{folder} is not a multigpu run folder with finished epochs (no "
                         f"{runfolder.METRICS}): give folders under runs/, made by multigpu train")
    epochs = runfolder.read_metrics(folder)
    steps = []
    if (folder / STEPS_CSV).is_file():
        with open(folder / STEPS_CSV, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    steps.append((int(row["step"]), float(row["train/loss"])))
                except (KeyError, TypeError, ValueError):
                    continue
    return {"name": folder.name, "epochs": epochs, "steps": steps}


def draw(folders: list[Path], path: Path, title: str | None = None) -> Path:
    """Draw the runs in `folders` into the PNG `path` (written whole or not at all)."""
    runs = [read_run(f) for f in folders]
    matplotlib = require("matplotlib", "drawing curves.png")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colours[i % len(colours)]
        _draw_loss(loss_ax, run, c, label=run["name"] if len(runs) > 1 else None)
        _draw_validation(val_ax, run, c)
    classification = any("val_accuracy" in e for r in runs for e in r["epochs"])
    loss_ax.set(title="loss", xlabel="optimizer step",
                ylabel="cross-entropy" if classification else "MSE of the standardised values")
    losses = [v for r in runs for e in r["epochs"] for v in (e.get("train_loss"), e.get("val_loss"))]
    if losses and all(v is not None and v > 0 for v in losses):  # log scale, plain numbers
        from matplotlib.ticker import FuncFormatter

        loss_ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        loss_ax.yaxis.set_major_formatter(plain)
        loss_ax.yaxis.set_minor_formatter(plain)
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    val_ax.grid(alpha=0.3)
    val_ax.legend(fontsize=8)
    fig.suptitle(title or ", ".join(r["name"] for r in runs), fontsize=10)
    try:  # a temporary name of its own, then renamed: two runs drawing one file never clash
        return fileio.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)


def _steps_of(epochs: list[dict]) -> list[float]:
    """Each epoch's last step (older runs without `step`: the epoch number times its steps)."""
    return [e.get("step", e.get("epoch", i + 1)) for i, e in enumerate(epochs)]


def _draw_loss(ax, run: dict, colour: str, label: str | None) -> None:
    name = f"{label}: " if label else ""
    if run["steps"]:
        xs, ys = zip(*run["steps"])
        ax.plot(xs, ys, color=colour, alpha=0.35, linewidth=1, label=f"{name}train, per step (rank 0)")
    epochs = run["epochs"]
    x = _steps_of(epochs)
    ax.plot(x, [e.get("train_loss") for e in epochs], color=colour, marker="o", markersize=4,
            linewidth=1.5, label=f"{name}train, epoch mean")
    ax.plot(x, [e.get("val_loss") for e in epochs], color=colour, marker="s", markersize=4,
            linestyle="--", linewidth=1.5, label=f"{name}validation")


def _draw_validation(ax, run: dict, colour: str) -> None:
    epochs = run["epochs"]
    x = _steps_of(epochs)
    name = run["name"]
    if any("val_accuracy" in e for e in epochs):
        ax.plot(x, [100 * e.get("val_accuracy", float("nan")) for e in epochs], color=colour,
                marker="o", markersize=4, label=f"{name}: accuracy")
        ax.set(title="validation accuracy", xlabel="optimizer step", ylabel="accuracy (%)")
    elif any("val_mae" in e for e in epochs):
        ax.plot(x, [e.get("val_mae") for e in epochs], color=colour, marker="o", markersize=4,
                label=f"{name}: MAE")
        ax.plot(x, [e.get("val_rmse") for e in epochs], color=colour, marker="s", markersize=4,
                linestyle="--", label=f"{name}: RMSE")
        ax.set(title="validation error", xlabel="optimizer step",
               ylabel="error (the series' own units)")
