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
from multigpu.train.findings import Finding

_FIX_UNUSED = ("use it in the forward, or freeze it (requires_grad_(False)), or run with "
               "`multigpu run --auto --auto-unused` (DDP then looks for unused parameters each "
               "step: slower)")


def auto_trial_findings(cmd: list[str], plan, steps: int, timeout: float) -> list[Finding]:
    """Run `cmd` (a multigpu.auto.worker command line) as doctor's trial; its findings."""
    found = trial_findings(cmd, plan, steps, timeout, loaders=loader_findings)
    return [_unused_stops(f) if f.check == "unused params" and f.level == "warn" else f
            for f in found]


def loader_findings(records: list[dict], ranks: int) -> list[Finding]:
    """The DataLoaders rank 0 (or the first record) read with gradients on: split by --auto or not."""
    first = next((r for r in records if r["rank"] == 0), records[0])
    found = []
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
