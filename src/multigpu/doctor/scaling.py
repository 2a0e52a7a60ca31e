"""Trap 4, measured: is N devices at this per-device batch faster than one?

`multigpu doctor --scaling` times a few steps of the run's model and batch on one device and on
all of the plan's devices, through `multigpu bench` (same step, launcher and turns), in a
temporary folder, and says the speed-up with advice.
"""
from __future__ import annotations

import shutil
import tempfile

from multigpu.train.settings.config import TrainConfig
from multigpu.core.findings import Finding

POOR = 0.6  # scaling efficiency under which communication and waiting dominate


def scaling_finding(cfg: TrainConfig, plan) -> Finding:
    from multigpu.bench import BenchSettings, run_bench

    n = len(plan.gpu_ids) if plan.accelerator == "cuda" else plan.nproc
    if n < 2:
        return Finding("ok", "scaling", "one device: nothing to compare", trap=4)
    folder = tempfile.mkdtemp(prefix="multigpu-doctor-")
    try:
        rep = run_bench(BenchSettings(
            models=(cfg.model,), batch_sizes=(cfg.input.batch_size,), precision=cfg.numerics.precision,
            gpus=(1, n), methods=("multigpu-single", "multigpu-ddp"), steps=10, warmup=3, trials=3,
            image_size=cfg.input.image_size, devices=cfg.devices, min_free_memory=cfg.min_free_memory,
            out=folder + "/"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stopped = ("interrupted", "stopped by a signal")  # bench's notes of a Ctrl-C or SIGTERM
    if any(note.startswith(stopped) for note in rep.get("notes", [])):
        raise KeyboardInterrupt  # Ctrl-C reached the timing: stop the doctor, as at any moment
    row = next((r for r in rep.get("rows", []) if r["method"] == "multigpu-ddp" and r["gpus"] == n), None)
    if row is None or row.get("scaling_efficiency") is None:
        return Finding("warn", "scaling", f"the 1 vs {n} device timing did not finish: run "
                                          f"multigpu bench --model {cfg.model} --batch-size "
                                          f"{cfg.input.batch_size} --devices {cfg.devices} --gpus 1,{n} "
                                          "to see why", trap=4)
    eff = row["scaling_efficiency"]
    said = (f"{n} devices at --batch-size {cfg.input.batch_size} each train {eff * n:.2f}x as fast as one "
            f"({eff:.0%} of linear; synthetic data, {row['step_ms']:.0f} ms a step)")
    if eff >= POOR:
        return Finding("ok", "scaling", said, trap=4)
    return Finding("warn", "scaling", f"{said}: communication and waiting outweigh the work of so "
                                      f"small a batch; use --batch-size {cfg.input.batch_size * 4} (with "
                                      "a matching --lr) or fewer devices", trap=4)
