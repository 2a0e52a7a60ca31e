"""The launch environments of schedulers beside SLURM (sysinfo.slurm_launch_defaults), read the
same way, so that `multigpu train ...` as a pod's or a task's command runs across its nodes with
no launch flags:

- Kubeflow Trainer's torch runtime sets torchrun's own variables for every pod: PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT. Its master address is the
  DNS name of node 0's pod, which resolves only once that pod is up: `wait_for_master` waits for
  it (up to --start-timeout), saying so, then fails in one line.
- SkyPilot sets SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one per line, node 0's first),
  SKYPILOT_NUM_NODES and SKYPILOT_NUM_GPUS_PER_NODE on every node of a task.

Flags given on the command line win over these, as over SLURM's.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

from multigpu.core.errors import UsageError

KUBEFLOW = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
SKYPILOT = ("SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS", "SKYPILOT_NUM_NODES",
            "SKYPILOT_NUM_GPUS_PER_NODE")


def _number(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise UsageError(f"{name}={env.get(name)!r}: a whole number was expected (the scheduler "
                         "sets it on every node); unset it, or give the launch flags "
                         "(--nnodes, --node-rank, --master-addr)") from None


def kubeflow_defaults(env: Mapping[str, str]) -> dict[str, object]:
    """What Kubeflow Trainer's torch runtime tells a pod; empty outside one, or on one node."""
    if "PET_NNODES" not in env or "PET_NODE_RANK" not in env:
        return {}
    nnodes = env["PET_NNODES"].strip()
    if nnodes == "1":
        return {}
    found = {"source": "Kubeflow (PET_*)", "nnodes": nnodes,
             "node_rank": _number(env, "PET_NODE_RANK"),
             "master_addr": env.get("PET_MASTER_ADDR") or None, "master_name": "PET_MASTER_ADDR"}
    if env.get("PET_MASTER_PORT"):
        found["master_port"] = _number(env, "PET_MASTER_PORT")
    return found


def skypilot_defaults(env: Mapping[str, str]) -> dict[str, object]:
    """What SkyPilot tells each node of a task; empty outside one, or on one node."""
    if "SKYPILOT_NODE_RANK" not in env or "SKYPILOT_NUM_NODES" not in env:
        return {}
    nnodes = _number(env, "SKYPILOT_NUM_NODES")
    if nnodes <= 1:
        return {}
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    if len(ips) != nnodes:
        raise UsageError(f"SKYPILOT_NODE_IPS names {len(ips)} node(s) and SKYPILOT_NUM_NODES is "
                         f"{nnodes}: give the launch flags (--nnodes, --node-rank, --master-addr)")
    task = env.get("SKYPILOT_TASK_ID")
    return {"source": "SkyPilot (SKYPILOT_*)", "nnodes": str(nnodes),
            "node_rank": _number(env, "SKYPILOT_NODE_RANK"), "master_addr": ips[0],
            "master_name": "SKYPILOT_NODE_IPS", **({"rdzv_id": f"skypilot-{task}"} if task else {})}


def cluster_launch_defaults(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The first of Kubeflow's and SkyPilot's launch facts present, else {}."""
    env = os.environ if env is None else env
    return kubeflow_defaults(env) or skypilot_defaults(env)


def wait_for_master(host: str, name: str, timeout: float, say: Callable[[str], None],
                    resolve=socket.getaddrinfo) -> None:
    """Until `host` resolves (a pod's DNS name exists once the pod is up), for up to `timeout`
    seconds, said once; then one line. `name`: the variable it came from."""
    deadline, said = time.monotonic() + timeout, False
    while True:
        try:
            resolve(host, None)
            return
        except (socket.gaierror, UnicodeError):
            pass
        if time.monotonic() >= deadline:
            raise UsageError(f"{name} {host} did not resolve in {timeout:g} s (node 0's pod or "
                             "machine not up, or the name is wrong): check that it is running, or "
                             "give a longer --start-timeout")
        if not said:
            say(f"multigpu: waiting for {name} {host} to resolve (node 0 may still be starting; "
                f"at most {timeout:g} s, --start-timeout)")
            said = True
        time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
