"""Checks of a run's setup that need no model: the launch environment, the devices, precision,
and the plan of each epoch's steps (the last one, the validation set's sharding).

Each returns Findings (findings.py); `multigpu doctor` prints them, `multigpu train` and
`multigpu run` fire the cheap ones themselves before they start a process. Importing it does not
import torch (`multigpu train` refuses stale launch variables before that slow import).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from multigpu.core.findings import Finding
from multigpu.core.errors import UsageError
from multigpu.train.settings.flagwords import say

LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_AGENT_VAR = "TORCHELASTIC_RUN_ID"  # torchrun's agent sets it in every worker it starts


def stale_launch_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """The launch variables set in a process that no launcher started (left in the shell by an
    earlier `export` or a tutorial); {} inside a torchrun worker."""
    if _AGENT_VAR in environ:
        return {}
    return {k: environ[k] for k in LAUNCH_VARS if k in environ}


def _unset_fix(stale: Mapping[str, str]) -> str:
    return f"unset {' '.join(stale)} (multigpu's launcher sets its own for every process)"


def launch_env_findings(environ: Mapping[str, str]) -> list[Finding]:
    """Trap 8: variables of an earlier launch that a new one would trip over."""
    stale = stale_launch_vars(environ)
    if not stale:
        return [Finding("ok", "launch env", "no launch variable (MASTER_PORT, RANK, WORLD_SIZE, ...) "
                                            "left in the environment", trap=8)]
    shown = ", ".join(f"{k}={v}" for k, v in stale.items())
    harm = []
    if "LOCAL_RANK" in stale:
        harm.append("`multigpu train` refuses to start")
    if stale.get("WORLD_SIZE", "1") not in ("0", "1") and "LOCAL_RANK" in stale:
        harm.append(f"multigpu.setup() in a plain `python script.py` would wait for "
                    f"{stale['WORLD_SIZE']} processes that never come")
    if not harm:
        harm.append("a plain `python script.py` that reads them would use the old values")
    return [Finding("warn", "launch env", f"{shown} set in this shell, left from an earlier launch: "
                                          f"{'; '.join(harm)}; {_unset_fix(stale)}", trap=8)]


_COMPLETE = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def refuse_stale_worker_env(environ: Mapping[str, str], warn=None) -> None:
    """`multigpu train` run by hand with LOCAL_RANK exported: it takes itself for a worker and
    would train alone or, with WORLD_SIZE > 1, wait 30 minutes for peers that never come.
    LOCAL_RANK without the rest of a launch's variables can only be left over: refused. The whole
    set without torchrun may be another launcher's (DeepSpeed, an MPI or SLURM wrapper): `warn`
    gets one line saying how it is taken."""
    stale = stale_launch_vars(environ)
    if "LOCAL_RANK" not in stale:
        return
    shown = ", ".join(f"{k}={v}" for k, v in stale.items())
    if all(k in stale for k in _COMPLETE):
        if warn is not None:
            warn(f"{shown} set without torchrun: taken as a worker of another launcher; if they "
                 f"are left from an earlier launch, {_unset_fix(stale)}")
        return
    raise UsageError(f"{shown} set, but no launcher started this process (these are left from "
                     f"an earlier launch): {_unset_fix(stale)}")


def device_findings(spec: str, *, one_process: bool, min_free_memory_gb: float):
    """Trap 13: (findings, plan or None). The plan is what `multigpu train` would choose now;
    nothing is leased."""
    from multigpu.launcher.devices import resolve_devices

    try:
        plan = resolve_devices(spec, one_process=one_process, min_free_memory_gb=min_free_memory_gb)
    except UsageError as exc:
        return [Finding("fail", "devices", str(exc), trap=13)], None
    note = "" if plan.accelerator == "cpu" else f"; free memory at least {min_free_memory_gb:g} GiB each"
    found = [Finding("ok", "devices", f"--devices {spec}: {plan.describe()}{note}", trap=13)]
    if plan.crowded():
        found.append(Finding("warn", "devices", plan.crowded()))
    return found, plan


def precision_findings(kind: str, plan, model: str = "") -> list[Finding]:
    """bf16 where the GPUs compute it natively; fp16 with its scaler; fp32 on CPUs and for the
    small sequence models (model_names.precision_for)."""
    if plan is None:
        return []
    if plan.accelerator == "cpu":
        if kind in ("bf16", "fp16"):
            return [Finding("ok", "precision", f"{kind} autocast on CPU processes (a CPU without "
                                               f"{kind} units emulates it: compare the speed with "
                                               "--precision fp32)")]
        return [Finding("ok", "precision", "fp32 on CPU processes")]
    import torch

    from multigpu.train.models.model_names import precision_for

    if kind == "auto" and precision_for(kind, model) == "fp32":
        return [Finding("ok", "precision", f"--precision auto is fp32 for {model}: its small steps "
                                           "are faster without bf16 autocast")]
    names = set(plan.gpu_names) or {"the GPU"}
    old = [i for i in plan.gpu_ids if torch.cuda.get_device_capability(i) < (8, 0)]
    if kind == "bf16" and old:
        return [Finding("fail", "precision", f"--precision bf16 on GPU {old[0]} ({', '.join(names)}), "
                                             "which has no bf16 units (before Ampere): use "
                                             "--precision fp16 (with loss scaling) or fp32")]
    if kind == "auto":
        chosen = "fp32 (no bf16 units)" if old else "bf16"
        return [Finding("ok", "precision", f"--precision auto is {chosen} on {', '.join(names)}")]
    if kind == "fp16":
        return [Finding("ok", "precision", "fp16: autocast, and the GradScaler steps inside "
                                           "rt.step; skipped steps are counted", trap=7)]
    return [Finding("ok", "precision", f"{kind} on {', '.join(names)}")]


def last_step_finding(n: int, batch_size: int, *, ranks: int, devices_per_rank: int = 1,
                      drop_last: bool = False) -> Finding:
    """Trap 3: what the last step of each epoch is, and what happens to it."""
    from multigpu.core.loading.data import ShardedBatchSampler, split_share  # torch: not for a usage error

    devices = ranks * devices_per_rank
    try:
        plan = ShardedBatchSampler(n, batch_size, num_ranks=ranks, devices_per_rank=devices_per_rank,
                                   drop_last=drop_last).full_plan
    except UsageError as exc:
        return Finding("fail", "last step", say(exc), trap=3)
    step = batch_size * devices
    head = (f"{n} training samples, {batch_size} per device x {devices} device"
            f"{'s' if devices != 1 else ''} = {step} per step: {len(plan)} step"
            f"{'s' if len(plan) != 1 else ''}")
    if len(plan) == 1:
        return Finding("warn", "last step", f"{head}: one optimizer step per epoch; a smaller "
                                            "--batch-size gives the optimizer more steps", trap=3)
    full, rest = divmod(n, step)
    last = plan[-1][1] - plan[-1][0]
    if rest == 0:
        return Finding("ok", "last step", f"{head}, all full", trap=3)
    if drop_last:
        return Finding("ok", "last step", f"{head}; the last {rest} samples of each epoch's order "
                                          "are dropped (--drop-last; a new order each epoch)", trap=3)
    shares = [hi - lo for lo, hi in (split_share(*plan[-1], ranks, r) for r in range(ranks))]
    split = ("+".join(map(str, shares)) if ranks <= 8 else
             f"{min(shares)} to {max(shares)}")  # 99 shares are no help on one line
    if last == rest:
        how = (f"the last has {rest} ({split} per process), no device empty, the loss averaged "
               f"over those {rest}")
    else:
        how = (f"a remainder of {rest} (too few for {min(2, batch_size)} per device) joins the step "
               f"before it, which has {last} ({split} per process)")
    return Finding("ok", "last step", f"{head}; {how}; every sample once per epoch", trap=3)


def eval_coverage_finding(n: int, batch_size: int, *, ranks: int, devices_per_rank: int = 1) -> Finding:
    """The self-check of exact evaluation: over every rank's share of the validation set (as
    rt.prepare shards it), each sample is counted exactly once."""
    from multigpu.core.loading.data import ShardedBatchSampler

    seen: Counter = Counter()
    for r in range(ranks):
        s = ShardedBatchSampler(n, batch_size, num_ranks=ranks, rank=r, devices_per_rank=devices_per_rank)
        for indices in s:
            seen.update(indices)
    twice = sum(1 for c in seen.values() if c > 1)
    missing = n - len(seen)
    if twice or missing:
        return Finding("fail", "evaluation", f"{twice} validation samples counted twice and "
                                             f"{missing} never over {ranks} processes: a bug in "
                                             "multigpu, please report it")
    return Finding("ok", "evaluation", f"each of the {n} validation samples counted once over "
                                       f"{ranks} process{'es' if ranks != 1 else ''}", trap=14)
