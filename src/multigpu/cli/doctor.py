"""`multigpu doctor`: look for the known multi-GPU traps before a run, one line per check.

    multigpu doctor --model resnet50 --data folder:./imgs --batch-size 256 --devices 4
    multigpu doctor --config run.yaml                 the checks of that `multigpu train` run
    multigpu doctor --devices 2 -- train.py --lr 0.1  a script for `multigpu run`: read, then run
                                                      up to its first optimizer step
    multigpu doctor --devices 2 -- -m pkg.train       the same for a module
    multigpu doctor --auto --devices 2 train.py       what `multigpu run --auto` will change in
                                                      a one-device script, then its first step
                                                      under --auto

With train options it checks the launch environment, the devices, the precision, what the last
step of each epoch will be, the validation set's sharding, and runs one real training and
evaluation step on the first device: parameters without a gradient, peak memory, and the largest
per-GPU batch that fits; it ends with what up to 20 timed steps predict: the time an epoch, the
whole run and its device-hours, evaluation and checkpoint pauses included. With a script it
reads the script's source for the traps a source shows, then runs it as `multigpu run` would, in
the current folder, and stops every rank right after its first optimizer step (--steps N: the
N-th): the parameters without a gradient, the training DataLoaders that are not sharded, the
batch per rank and the peak memory, as the ranks saw them. What the script writes before that
step stays (listed); nothing after it runs. A script that reaches no torch.optim step within
--trial-timeout is stopped there. With --steps 3 or more it ends with the time a step from the
steps after the first, and an epoch where its training DataLoader's length is known. --no-step:
read only. --scaling, with several devices: the speed-up of all of them over one, from steps timed
on both (train options: through multigpu bench; a script: run again on its first device alone).
With --auto: each change of `multigpu run --auto` at its line in the script, the refusals its
source shows (warn: --auto refuses what the script does when it runs, so the run decides), then
the script under --auto up to its first optimizer step, where a refusal is a fail.
Each line is ok, warn or fail, with the cause and the fix; the exit status is 1 when one failed.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

from multigpu.auto import BATCH_MODES
from multigpu.train.settings import configfile
from multigpu.core import console
from multigpu.train.settings.config import TrainConfig, add_config_arguments, config_from_args
from multigpu.core.errors import UsageError
from multigpu.train.settings.flagwords import say

AUTO_PROBE_BATCH = 32
DEFAULT_TRIAL_TIMEOUT = 300.0  # seconds: the start-up and first steps of most scripts, with room
HEADLINE = "multigpu doctor: checks before a run (ok / warn / fail), trap numbers as in docs/traps.md"


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor", help="look for the known multi-GPU traps before a run (train options, or -- script.py)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    for action in p._actions:  # --model is not needed with a script (argparse has no accessor)
        if action.dest == "model":
            action.required = False
    p.add_argument("--config", metavar="FILE", help="read the train settings from a YAML or JSON file")
    p.add_argument("--no-step", action="store_true",
                   help="skip the real training step (memory, unused parameters, the batch that "
                        "fits); with a script: read it, do not run it")
    p.add_argument("--steps", type=int, default=1, metavar="N",
                   help="with a script: run it up to its N-th optimizer step, then stop it "
                        "(default 1)")
    p.add_argument("--trial-timeout", type=float, default=DEFAULT_TRIAL_TIMEOUT, metavar="SECONDS",
                   help="with a script: stop every rank when none reached that step after this "
                        "long (a weight update without torch.optim, evaluation only, a stuck data "
                        f"loader; default {DEFAULT_TRIAL_TIMEOUT:g})")
    p.add_argument("--no-batch-search", action="store_true",
                   help="skip the search for the largest batch that fits (GPUs only)")
    p.add_argument("--scaling", action="store_true",
                   help="with several devices, also time steps on 1 device and end with the "
                        "speed-up of all of them (trap 4): train options through multigpu bench "
                        "(30-60 s more on a CPU); a script (with --steps 3 or more) run again on "
                        "its first device alone")
    p.add_argument("--auto", action="store_true",
                   help="with a script: say what `multigpu run --auto` will change in it, line by "
                        "line, then run it under --auto up to its first optimizer step")
    p.add_argument("--auto-batch", choices=BATCH_MODES, default=None,
                   help="with --auto: as multigpu run --auto-batch (default global)")
    p.add_argument("script", nargs=argparse.REMAINDER, metavar="-- script.py ...",
                   help="a script to check as `multigpu run` would start it")
    configfile.read_config_first(p, on_note=console.info)
    return p


def main(args: argparse.Namespace) -> int:
    script = list(args.script)
    if script[:1] == ["--"]:
        script = script[1:]
    if script and args.model:
        raise UsageError("give either train options (--model ...) or a script after --, not both")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give the optimizer steps to run a script for, 1 or "
                         "more, e.g. --steps 1 (--no-step: read the script, do not run it)")
    if not 0 < args.trial_timeout < float("inf"):
        raise UsageError(f"--trial-timeout {args.trial_timeout:g}: give the seconds a script may run "
                         "before its optimizer step, more than 0, e.g. --trial-timeout 300")
    if args.auto_batch is not None and not args.auto:
        raise UsageError(f"--auto-batch {args.auto_batch} is a choice of --auto: add --auto, or "
                         "drop --auto-batch")
    if args.auto and not script:
        raise UsageError("--auto checks a one-device script for `multigpu run --auto`: give it, "
                         "e.g. multigpu doctor --auto train.py ARGS")
    if not script and not args.model:
        raise UsageError("--model is required to check a multigpu train run (e.g. --model "
                         "resnet18 --data ...); for a script: multigpu doctor -- train.py ARGS")
    if args.scaling and args.auto:
        raise UsageError("--scaling times a script's steps on 1 and on all the devices as it is; "
                         "under --auto it is another script: leave --scaling out, or time the "
                         "script without --auto, e.g. multigpu doctor --scaling --steps 3 -- t.py")
    if script and args.scaling and args.steps < 3:
        raise UsageError(f"--scaling times a script's steps from the second on, on 1 and on all the "
                         f"devices: --steps {args.steps} times none; add --steps 3 or more")
    if script:
        return _report(_script_checks(args, script))
    print(HEADLINE, flush=True)
    return _report(_train_checks(args))


def _report(findings) -> int:
    """The checks, their count, then the estimate and the scaling (not checks: what the steps
    timed predict)."""
    from multigpu.core.findings import report

    last = [f for f in findings if f.check == "estimate"] + [f for f in findings if f.check == "scaling"]
    code = report([f for f in findings if f not in last])
    for f in last:
        print(f"{f.check:<10} {f.message}", flush=True)
    return code


def _script_checks(args, script: list[str]):
    from multigpu.doctor.script_checks import script_findings
    from multigpu.doctor.shell_checks import file_crlf_finding
    from multigpu.train.checks.setup_checks import device_findings, launch_env_findings

    given = script  # what the trial starts: a module stays a module (its relative imports)
    if script[0] == "-m" and len(script) > 1:  # -- -m pkg.train ARGS, as multigpu run -m takes it
        from multigpu.launcher.scripts import module_source

        source = module_source(script[1])
        if source is None:
            raise UsageError(f"-m {script[1]}: its source was not found as a .py file; give the "
                             "script's path instead")
        path, script = source, [str(source), *script[2:]]
    else:
        path = Path(script[0])
    if not path.is_file():
        raise UsageError(f"script {script[0]!r} not found (in {os.getcwd()}); give the path of "
                         "the script, e.g. multigpu doctor -- train.py, or -- -m package.module")
    worker = _auto_worker(args, given, path) if args.auto else None  # refuses a non-Python file
    print(HEADLINE, flush=True)  # after the mistakes that end in one line instead of a report
    findings = launch_env_findings(os.environ)
    found, plan = device_findings(args.devices, one_process=False,
                                  min_free_memory_gb=args.min_free_memory)
    findings += found
    if plan is not None:
        nproc, gpus = plan.nproc, plan.accelerator == "cuda"
    else:  # GPUs asked for that are not here (a laptop, before the GPU box): check for them all
        gpus = not args.devices.strip().lower().startswith("cpu")
        nproc = int(args.devices) if args.devices.strip().isdigit() else 2
    if args.auto:
        failed = any(f.level == "fail" for f in findings)
        return findings + _auto_checks(args, worker, given, path, plan, nproc, failed=failed)
    findings += script_findings(path, nproc=nproc, gpus=gpus)
    for arg in script[1:]:  # a config or shell file handed to the script (trap 9)
        if os.path.isfile(arg) and (f := file_crlf_finding(Path(arg))) is not None:
            findings.append(f)
    if not args.no_step and plan is not None:
        findings += _script_trial(args, given, path, plan, failed=any(f.level == "fail" for f in findings))
    return findings


def _script_trial(args, script: list[str], path: Path, plan, *, failed: bool):
    """The script run up to its --steps-th optimizer step on every device, as multigpu run
    starts it; not when a check above failed (it would hang or crash) or for a shell script."""
    from multigpu.launcher import devices, launch
    from multigpu.launcher.scripts import local_rank_args, script_command
    from multigpu.core.findings import Finding
    from multigpu.doctor.script_trial import trial_findings

    if failed:
        return [Finding("warn", "script run", "not run: a check above failed; fix it, then doctor "
                                              "runs the script up to its first optimizer step")]
    if script[0] == "-m":
        cmd, rest = script[:2], script[2:]
    else:
        rest = script[1:]
        cmd, python = script_command(path)
        if not python:
            return [Finding("ok", "script run", "not run: a shell script; doctor runs a Python "
                                                "script or module given after --")]
    cmd = launch.python_command("multigpu.launcher.rank.worker", *cmd, *local_rank_args("auto", path))
    devices.lease(plan, f"multigpu doctor {script[0]}", args.min_free_memory)
    then = None
    if args.scaling and plan.nproc > 1:  # the same script on its first device alone, after
        from multigpu.doctor.scaling import script_scaling_findings

        def then(records, cmd=cmd + rest):
            return script_scaling_findings(cmd, plan, args.steps, args.trial_timeout, records)
    return trial_findings(cmd + rest, plan, args.steps, args.trial_timeout, then=then)


def _auto_worker(args, script: list[str], path: Path) -> list[str]:
    """The command of --auto's worker for the script (a UsageError for a file that is not Python)."""
    from multigpu.cli.run import auto_command
    from multigpu.launcher.scripts import script_command

    mode = args.auto_batch or BATCH_MODES[0]
    cmd = script[:2] if script[0] == "-m" else script_command(path)[0]
    return auto_command(script[0], cmd, script[0] == "-m" or script_command(path)[1], mode)


def _auto_checks(args, worker: list[str], script: list[str], path: Path, plan, nproc: int, *,
                 failed: bool):
    """What --auto will change, read from the source; then the trial under --auto's worker."""
    from multigpu.doctor.auto_checks import auto_findings

    mode = args.auto_batch or BATCH_MODES[0]
    run = not args.no_step and plan is not None
    findings = auto_findings(path, nproc=nproc, mode=mode, ran=run)
    if not run:
        return findings
    if failed or any(f.level == "fail" for f in findings):
        from multigpu.core.findings import Finding

        return findings + [Finding("warn", "script run", "not run: a check above failed; fix "
                                                         "it, then doctor runs the script under "
                                                         "--auto up to its first optimizer step")]
    from multigpu.doctor.auto_trial import auto_trial_findings
    from multigpu.launcher import devices

    devices.lease(plan, f"multigpu doctor --auto {script[0]}", args.min_free_memory)
    rest = script[2:] if script[0] == "-m" else script[1:]
    return findings + auto_trial_findings(worker + rest, plan, args.steps, args.trial_timeout)


def _train_checks(args):
    from multigpu.cli.resume_checks import check_resume
    from multigpu.cli.train import validate
    from multigpu.train.checks import setup_checks
    from multigpu.core.findings import Finding
    from multigpu.core.strategies import registry

    try:
        cfg: TrainConfig = config_from_args(args)  # each component checks its values
        validate(cfg)
        cfg = check_resume(cfg)  # the checkpoint that --resume names, read as train reads it
    except UsageError as exc:
        return [Finding("fail", "options", say(exc))]
    findings = setup_checks.launch_env_findings(os.environ)
    strategy = registry.info(cfg.parallel.strategy)
    found, plan = setup_checks.device_findings(cfg.devices, one_process=strategy.one_process,
                                               min_free_memory_gb=cfg.min_free_memory)
    findings += found
    if plan is None:
        return findings
    if cfg.input.batch_size == "auto":
        if plan.accelerator != "cuda" or not strategy.auto_batch:
            return findings + [Finding("fail", "batch size", "--batch-size auto needs one process "
                                                             "per GPU; give a number, e.g. --batch-size 64")]
        cfg = replace(cfg, input=replace(cfg.input, batch_size=AUTO_PROBE_BATCH))
        findings.append(Finding("ok", "batch size", f"--batch-size auto: the checks below use "
                                                    f"{AUTO_PROBE_BATCH} per GPU; 'batch fit' is the size "
                                                    "auto picks on this GPU", trap=2))
    findings += setup_checks.precision_findings(cfg.numerics.precision, plan, cfg.model)
    findings += _plan_checks(cfg, plan)
    if not args.no_step and not any(f.level == "fail" for f in findings):
        from multigpu.doctor.probe import probe_findings

        unused_fails = plan.nproc > 1 and strategy.unused_fails
        findings += probe_findings(cfg, plan, unused_fails=unused_fails,
                                   find_batch=not args.no_batch_search)
    if args.scaling and not any(f.level == "fail" for f in findings):
        from multigpu.doctor.scaling import scaling_findings

        findings += scaling_findings(cfg, plan)
    return findings


def _plan_checks(cfg: TrainConfig, plan):
    """The last step of each epoch and the validation sharding, from the data's real sizes."""
    from multigpu.core.findings import Finding
    from multigpu.train.checks.setup_checks import eval_coverage_finding, last_step_finding
    from multigpu.train.training import load_run_data

    try:
        data = load_run_data(cfg)
    except UsageError as exc:
        return [Finding("fail", "data", say(exc))]
    ranks = plan.nproc
    per_rank = len(plan.gpu_ids) if plan.nproc == 1 and len(plan.gpu_ids) > 1 else 1
    kind, _, arg = cfg.input.data.partition(":")
    if kind == "shards":
        from multigpu.train.data.shard_layout import shard_findings

        shards = shard_findings(arg)
    else:
        shards = []
    return shards + [last_step_finding(len(data.train), cfg.input.batch_size, ranks=ranks,
                              devices_per_rank=per_rank, drop_last=cfg.input.drop_last),
            eval_coverage_finding(len(data.val), cfg.input.batch_size, ranks=ranks,
                                  devices_per_rank=per_rank)]

