"""Facts about the machine and the cluster: the SLURM allocation, and the `multigpu env` report."""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping

# --------------------------------------------------------------------------- SLURM


def expand_nodelist(nodelist: str) -> list[str]:
    """'node[01-03],gpu7' -> ['node01', 'node02', 'node03', 'gpu7'] (SLURM hostlist syntax):
    first_slurm_host's fallback where SLURM's own `scontrol` cannot answer.

    Handles ranges with zero padding, lists inside brackets and several bracket groups
    ('rack[1-2]-n[1,3]'), as scontrol expands them. Raises ValueError on text it does not
    understand.
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        expanded = [""]
        for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            choices = [literal]
            if group:
                choices = [literal + n for n in _expand_group(group, item)]
            expanded = [e + c for e in expanded for c in choices]
        hosts += [h for h in expanded if h]
    if not hosts:
        raise ValueError(f"empty SLURM nodelist {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in SLURM nodelist {text!r}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced brackets in SLURM nodelist {text!r}")
    return [x for x in out + [cur] if x]


def _expand_group(group: str, item: str) -> list[str]:
    out = []
    for part in group.split(","):
        if m := re.fullmatch(r"(\d+)-(\d+)", part):
            lo, hi = m.groups()
            out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
        elif re.fullmatch(r"\d+", part):
            out.append(part)
        else:
            raise ValueError(f"cannot read {part!r} in SLURM nodelist entry {item!r}")
    return out


def first_slurm_host(nodelist: str) -> str:
    """First host of a nodelist, as SLURM expands it (`scontrol show hostnames`, there wherever
    SLURM runs a job); our parser where scontrol is missing or cannot answer: it reads
    slurm.conf, which a container without SLURM's client or config does not have."""
    conf = os.environ.get("SLURM_CONF")
    # a SLURM_CONF that is not there makes scontrol retry for 60 s; without one it fails at once
    if shutil.which("scontrol") and (conf is None or os.path.isfile(conf)):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist],
                                 capture_output=True, text=True, timeout=5)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_nodelist(nodelist)[0]


def slurm_launch_defaults(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """What a multi-node SLURM step tells us: nnodes, node_rank, master_addr, rdzv_id.

    Empty unless we run inside a SLURM allocation of more than one node.
    """
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
        return {}
    nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    if nnodes <= 1:
        return {}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    step = env.get("SLURM_STEP_ID", "")
    return {
        "nnodes": str(nnodes),
        "node_rank": int(env["SLURM_NODEID"]),
        "master_addr": first_slurm_host(nodelist) if nodelist else None,
        "rdzv_id": f"slurm-{env['SLURM_JOB_ID']}" + (f".{step}" if step else ""),
        "tasks": int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or nnodes),
    }


# --------------------------------------------------------------------------- `multigpu env`

ENV_PATTERNS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_", "MASTER_", "TORCH_",
                "TORCHELASTIC_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "SLURM_", "NVSHMEM_",
                "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTORCH_", "GLOO_")


def relevant_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    return {k: env[k] for k in sorted(env)
            if any(k == p or (p.endswith("_") and k.startswith(p)) for p in ENV_PATTERNS)}


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def torch_facts() -> dict[str, str]:
    try:
        import torch
    except ImportError:
        return {"torch": "not installed"}
    facts = {"torch": torch.__version__, "CUDA (torch built with)": str(torch.version.cuda),
             "cuDNN": str(torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
                          else None)}
    try:
        nccl = torch.cuda.nccl.version()
        facts["NCCL"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        facts["NCCL"] = "not available"
    facts["torch.cuda.is_available"] = str(torch.cuda.is_available())
    facts["distributed backends"] = ", ".join(
        b for b, ok in (("gloo", torch.distributed.is_gloo_available()),
                        ("nccl", torch.distributed.is_nccl_available())) if ok) or "none"
    return facts


def driver_facts() -> dict[str, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return {"NVIDIA driver": f"not found ({exc})"}
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return {"NVIDIA driver": str(pynvml.nvmlSystemGetDriverVersion()),
                "CUDA (driver supports)": f"{cuda // 1000}.{cuda % 1000 // 10}"}
    except Exception as exc:
        return {"NVIDIA driver": f"unknown ({exc})"}
    finally:
        pynvml.nvmlShutdown()


def gpu_topology() -> str | None:
    """`nvidia-smi topo -m` (how the GPUs are connected: NVLink, PCIe), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout or out.stderr).rstrip()  # no colour codes


def system_facts() -> dict[str, str]:
    facts = {"multigpu": _version("multigpu"), "Python": sys.version.split()[0],
             "OS": platform.platform(), "CPUs": str(os.cpu_count())}
    if hasattr(os, "sched_getaffinity"):
        facts["CPUs usable by this process"] = str(len(os.sched_getaffinity(0)))
    try:
        import psutil

        facts["RAM"] = f"{psutil.virtual_memory().total / 1024**3:.0f} GB"
    except ImportError:
        pass
    return facts
