"""`multigpu gpus`: the GPUs of this machine, like nvidia-smi, marked free or busy.

Free/busy uses the same rule as `--devices auto`: enough free memory and nobody else's process.
"""
from __future__ import annotations

import argparse
import json

from multigpu.launcher import devices

GIB = devices.GIB


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("gpus", help="list the GPUs: memory, load, processes, free or busy",
                              description=__doc__)
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.add_argument("--min-free-memory", type=float, default=2.0, metavar="GB",
                   help="less free memory than this counts as busy (default 2)")
    return p


def gpu_rows(min_free_memory_gb: float) -> tuple[list[dict], str | None]:
    """One dict per physical GPU, and why there is none (None when NVML answered)."""
    try:
        gpus = devices.query_gpus()
    except devices.NvmlUnavailable as exc:
        return [], str(exc)
    cvd = devices.user_cuda_visible()
    visible_id = {v.info.index: v.id for v in devices.visible_gpus(gpus, cvd)}
    rows = []
    for g in gpus:
        why = devices.busy_reason(g, min_free_memory_gb)
        rows.append({
            "index": g.index, "id": visible_id.get(g.index), "name": g.name, "uuid": g.uuid,
            "memory_used_mib": g.memory_used // 2**20, "memory_total_mib": g.memory_total // 2**20,
            "utilization_pct": g.utilization, "free": why is None, "busy_reason": why,
            "processes": [{"pid": pid, "name": name,
                           "memory_mib": None if mem is None else mem // 2**20}
                          for pid, name, mem in g.processes],
        })
    return rows, None


def main(args) -> int:
    rows, error = gpu_rows(args.min_free_memory)
    cvd = devices.user_cuda_visible()
    if args.json:
        print(json.dumps({"gpus": rows, "cuda_visible_devices": cvd, "error": error}, indent=2))
        return 0
    if not rows:
        print(f"No GPU found ({error or 'NVML lists none'}). "
              "Use --devices cpu:N to run on the CPU.")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="GPUs" + (f" (CUDA_VISIBLE_DEVICES={cvd}: 'id' counts within it)"
                                  if cvd is not None else ""))
    for col in ("GPU", "id", "name", "memory used / total", "util", "state", "processes"):
        table.add_column(col, justify="right" if col in ("GPU", "id", "util") else "left")
    for r in rows:
        procs = "\n".join(f"{p['pid']} {p['name']}"
                          + ("" if p["memory_mib"] is None else f" {p['memory_mib']} MiB")
                          for p in r["processes"]) or "-"
        state = "[green]free[/]" if r["free"] else f"[red]busy[/] ({r['busy_reason']})"
        table.add_row(str(r["index"]), "-" if r["id"] is None else str(r["id"]), r["name"],
                      f"{r['memory_used_mib'] / 1024:.1f} / {r['memory_total_mib'] / 1024:.1f} GiB",
                      "-" if r["utilization_pct"] is None else f"{r['utilization_pct']}%",
                      state, procs)
    Console().print(table)
    return 0
