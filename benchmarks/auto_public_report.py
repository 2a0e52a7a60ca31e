"""What benchmarks/auto_public_scripts.py reports from its runs (auto_public_runs.collect's
dicts): per script, each run against the one-GPU runs; for ImageNet, each run's speedup, and
with --compare one line per process count that sets the causes of a shortfall side by side.

How to read a --compare line (N processes, all against the one-GPU script run's img/s):
- `ddp`, the script's own DistributedDataParallel mode at --auto's per-process batch and workers,
  is what this machine gives this script without --auto: --auto below it costs throughput of its
  own; --auto at it and both short of N x means the ceiling is elsewhere.
- `per-gpu`, --auto-batch per-gpu (the script's batch per GPU): well above `auto` means the
  smaller per-process batch (steps too short to hide per-step costs) is what holds `auto` back.
- `loader`, the data loading alone in N processes: below N x means the CPUs cannot feed N GPUs at
  the one-GPU rate, whatever the GPU step does.
- NCCL channels: how NCCL connects the processes (P2P, SHM, NET), from its own start-up lines.
  --auto narrows each process to its own GPU; a transport other than the ddp run's (SHM where
  ddp has P2P) is a cost of --auto's on every gradient all-reduce.
"""
from __future__ import annotations

import statistics

TARGET = {2: 1.8, 4: 3.5}  # the bar for the ImageNet script


def _rate(r: dict) -> float | None:
    return (r.get("throughput") or {}).get("images_per_s")


def summarise(results: list[dict]) -> dict:
    """Per script: the one-GPU accuracies' range, each other run inside it or not; ImageNet's
    speedups over its one-GPU runs' mean img/s."""
    out = {}
    for name in sorted({r["script"] for r in results}):
        mine = [r for r in results if r["script"] == name]
        ones = [r for r in mine if r["mode"] == "1gpu"]
        base = [r["accuracy"] for r in ones if r["accuracy"] is not None]
        rates = [_rate(r) for r in ones if _rate(r)]
        s = out[name] = {"one_gpu_accuracy": base}
        if rates:
            s["one_gpu_images_per_s"] = round(statistics.fmean(rates), 1)
        for r in (r for r in mine if r["mode"] != "1gpu"):
            v = s[r["run"]] = {
                "mode": r["mode"], "devices": r["devices"],
                "accuracy": r["accuracy"], "rc": r["rc"], "saved_once": r["saved_once"],
                "once_per_epoch": r["samples"]["once_per_epoch"],
                "nccl_transports": r.get("nccl_transports"),
                "within_one_gpu_range": (bool(base) and r["accuracy"] is not None
                                         and min(base) <= r["accuracy"] <= max(base))}
            if rates and _rate(r):
                v["speedup"] = round(_rate(r) / s["one_gpu_images_per_s"], 2)
    return out


def compare_lines(summary: dict) -> list[str]:
    """One line per process count of the ImageNet runs: each mode's speedup, side by side."""
    s = summary.get("imagenet", {})
    runs = {k: v for k, v in s.items() if isinstance(v, dict) and "speedup" in v}
    lines = []
    for n in sorted({v["devices"] for v in runs.values()}):
        parts = [f"{v['mode']} {v['speedup']}x" for k, v in runs.items() if v["devices"] == n]
        bar = f" (target {TARGET[n]}x)" if n in TARGET else ""
        lines.append(f"imagenet {n} process(es) vs the one-GPU run's "
                     f"{s['one_gpu_images_per_s']} img/s{bar}: " + ", ".join(parts))
    links = [f"{k} {v['nccl_transports']}" for k, v in s.items()
             if isinstance(v, dict) and v.get("nccl_transports")]
    if links:
        lines.append("imagenet NCCL channels (rank 0's under --auto, every rank's in ddp): "
                     + "; ".join(links))
    return lines


def table(results: list[dict], summary: dict) -> str:
    rows = ["script   run          rc  wall_s  acc%     saved_once  once/epoch  img/s     timed_s"]
    for r in results:
        tp, timed = _rate(r) or "", (r.get("throughput") or {}).get("seconds_timed", "")
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        rows.append(f"{r['script']:<8} {r['run']:<12} {r['rc']!s:<3} {r['wall_s']!s:<7} "
                    f"{acc:<8} {r['saved_once']!s:<11} {r['samples']['once_per_epoch']!s:<11} "
                    f"{tp!s:<9} {timed}")
    rows.append("")
    for name, s in summary.items():
        for key, v in s.items():
            if isinstance(v, dict) and v["mode"] in ("auto", "per-gpu"):
                rows.append(f"{name} {key}: accuracy {v['accuracy']} vs one-GPU "
                            f"{s['one_gpu_accuracy']} -> within range: "
                            f"{v['within_one_gpu_range']}; once per epoch: {v['once_per_epoch']}; "
                            f"saved once: {v['saved_once']}"
                            + (f"; speedup {v['speedup']}x" if "speedup" in v else ""))
    rows += compare_lines(summary)
    return "\n".join(rows) + "\n"
