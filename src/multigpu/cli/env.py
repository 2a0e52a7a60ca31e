"""`multigpu env`: a block describing this machine, to paste into a bug report."""
from __future__ import annotations

import argparse
import json

from multigpu.launcher import sysinfo
from multigpu.cli.gpus import gpu_rows


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("env", help="print versions, GPUs and settings for a bug report",
                              description=__doc__)
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    return p


def collect() -> dict:
    rows, error = gpu_rows(min_free_memory_gb=2.0)
    return {
        "system": sysinfo.system_facts(),
        "torch": sysinfo.torch_facts(),
        "driver": sysinfo.driver_facts(),
        "gpus": [f"{r['index']}: {r['name']}, {r['memory_total_mib'] / 1024:.0f} GiB, "
                 f"{'free' if r['free'] else 'busy (' + r['busy_reason'] + ')'}" for r in rows]
                or [f"none ({error or 'NVML lists none'})"],
        "topology": sysinfo.gpu_topology() if rows else None,
        "environment": sysinfo.relevant_env(),
    }


def main(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    lines = ["Copy and paste this block into your bug report:", "", "```"]
    for section in ("system", "torch", "driver"):
        lines += [f"- {k}: {v}" for k, v in info[section].items()]
    lines += ["- GPUs:"] + [f"    {g}" for g in info["gpus"]]
    if info["topology"]:
        lines += ["- GPU interconnect (nvidia-smi topo -m):"]
        lines += [f"    {line}" for line in info["topology"].splitlines()]
    env = [f"    {k}={v}" for k, v in info["environment"].items()]
    lines += ["- environment:"] + (env or ["    (none of CUDA_*, NCCL_*, MASTER_*, TORCH_*, ...)"])
    lines.append("```")
    print("\n".join(lines))
    return 0
