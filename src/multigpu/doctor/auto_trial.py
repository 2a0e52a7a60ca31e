"""`multigpu doctor --auto`'s trial: the script run under --auto's own worker (as `multigpu run
--auto` starts it) up to its first optimizer step(s), told in --auto's terms.

It is script_trial.py's trial, with the patches of --auto in place, so that what --auto decides
when the script runs is decided here for these arguments: a refusal stops the ranks there (a
fail, with the script's line), each training DataLoader is split or not as it will be, and the
batch each rank gives its model is the split one. Only the words change: a training loader that
was not split needs shuffle=True, not a DistributedSampler, and a parameter without a gradient
stops --auto's DDP at the next forward.
"""
from __future__ import annotations

from multigpu.doctor.script_trial import trial_findings
from multigpu.core.findings import Finding

_FIX_UNUSED = ("use it in the forward, or freeze it (requires_grad_(False)), or run with "
               "`multigpu run --auto --auto-unused` (DDP then looks for unused parameters each "
               "step: slower)")


def auto_trial_findings(cmd: list[str], plan, steps: int, timeout: float) -> list[Finding]:
    """Run `cmd` (a multigpu.auto.worker command line) as doctor's trial; its findings."""
    found = trial_findings(cmd, plan, steps, timeout, loaders=loader_findings)
    return [_unused_stops(f) if f.check == "unused params" and f.level == "warn" else f
            for f in found]


def no_optimizer_finding(records: list[dict], ranks: int) -> list[Finding]:
    """A script that trained a model (a forward with gradients on) and ended with no torch.optim
    step: --auto averaged nothing, as the run's note says at its first backward."""
    if ranks < 2 or not records or any(r["steps"] or not r.get("ended") or r.get("error")
                                       for r in records):
        return []
    if all(r.get("batch") is None for r in records):
        return []
    return [Finding("warn", "auto gradients", f"the script ended with no torch.optim optimizer "
                    f"step: --auto averages the gradients of what an optimizer holds, so nothing "
                    f"was averaged and each of the {ranks} ranks trained a model of its own "
                    "(rank 0's is the one kept); update the weights with a torch.optim optimizer")]


def loader_findings(records: list[dict], ranks: int) -> list[Finding]:
    """The DataLoaders rank 0 (or the first record) read with gradients on: split by --auto or not."""
    first = next((r for r in records if r["rank"] == 0), records[0])
    found = no_optimizer_finding(records, ranks)
    if not first["loaders"] and first.get("batch") is not None:  # the model ran on other batches
        found.append(Finding("warn", "auto data", f"the model's batches came from no DataLoader "
                             f"(a tensor sliced in a loop, a get_batch()): --auto splits only a "
                             f"DataLoader with shuffle=True, so each of the {ranks} ranks reads "
                             "all of the data; give it DataLoader(TensorDataset(x, y), "
                             "batch_size=..., shuffle=True)"))
    for ld in first["loaders"]:
        if ld["sharded"]:
            found.append(Finding("ok", "auto data", f"split by --auto: {ld['batches']} batches "
                                 f"per rank and epoch, each of its "
                                 f"{ld['samples']} samples once over the {ranks} ranks",
                                 where=ld["where"]))
        elif ld["sharded"] is False:
            found.append(Finding("warn", "auto data", f"a DataLoader read for training was not "
                                 f"split (it does not shuffle): each of the {ranks} ranks reads "
                                 f"all {ld['samples']} samples, the same batches; give it "
                                 "shuffle=True", where=ld["where"]))
    return found


def _unused_stops(f: Finding) -> Finding:
    """The trial's warn about parameters without a gradient: under --auto, a fail (its DDP
    does not look for unused parameters, so the next forward stops)."""
    head = f.message.split("; they never train:")[0]
    return Finding("fail", f.check, f"{head}; --auto's DDP stops at the next forward: "
                                    f"{_FIX_UNUSED}", trap=f.trap, where=f.where)
