"""The settings of a `multigpu sweep`: its spec and options from the sweep file, the flags and a
stored sweep folder (--resume), checked once with a one-line error naming the flag to change."""
from __future__ import annotations

import os
import re
from pathlib import Path

from multigpu.core.system import fileio
from multigpu.core.errors import UsageError

# the options a sweep file or the flags may give, stored in sweep.json for --resume and --status
OPTIONS = ("devices", "devices_per_run", "runs_per_gpu", "max_parallel", "timeout", "retries", "metric",
           "min_free_memory", "out", "on", "partition", "time", "slurm_arg", "nodes_per_run")


def resolve(args):
    """(spec, options, folder) from the file, the flags and an existing sweep folder."""
    from multigpu.sweep import spec as specs
    from multigpu.sweep.state import SweepFolder

    if args.resume:
        record = SweepFolder(Path(args.resume)).read_sweep()
        if record is None:
            raise UsageError(f"--resume {args.resume}: no sweep there (no sweep.json); give the "
                             "folder of a sweep (its --out)")
        spec = specs.SweepSpec(**record["spec"])
        specs.check(spec)
        options = {**record.get("options", {}), **option_flags(args)}
        root = Path(args.resume).absolute()
        if record.get("cwd") and Path(record["cwd"]).is_dir():
            os.chdir(record["cwd"])  # the command's relative paths are relative to it
        options["out"] = str(root)
        return spec, options, root
    file_path, command = split_rest(args.rest)
    spec, options = specs.SweepSpec([]), {}
    if file_path:
        from multigpu.train.settings.configfile import read_mapping

        data = read_mapping(file_path, "sweep file", examples=(
            "multigpu sweep sweep.yaml", "`command: multigpu train --model cnn --lr {lr}`"))
        spec, options = specs.from_mapping(data, file_path, allowed=OPTIONS)
    if command:
        spec.command = command
    for text in args.grid:
        key, values = specs.parse_grid_flag(text)
        for grid in spec.grids():  # a flag sets the key in every grid of the file
            grid[key] = values
    specs.check(spec)
    options.update(option_flags(args))
    root = Path(str(options.get("out") or Path("sweeps") / spec.fingerprint()))
    fileio.check_can_make(root if options.get("out") else "sweeps", "--out")
    return spec, options, root


def split_rest(rest: list[str]) -> tuple[str | None, list[str]]:
    """REMAINDER: `[SWEEP.yaml] [--] COMMAND...`, options after the file parsed again."""
    rest = list(rest)
    if rest and rest[0] == "--":
        return None, rest[1:]
    if rest and rest[0].lower().endswith((".yaml", ".yml", ".json")):
        file_path, tail = rest[0], rest[1:]
        if "--" in tail:
            head, command = tail[: tail.index("--")], tail[tail.index("--") + 1:]
        else:
            head, command = tail, []
        if head:
            raise UsageError(f"{' '.join(head)}: put options before the sweep file, e.g. "
                             f"multigpu sweep --max-parallel 2 {file_path}")
        return file_path, command
    return None, rest


def option_flags(args) -> dict:
    return {k: getattr(args, k) for k in OPTIONS if getattr(args, k, None) is not None}


def check_folder(spec, folder) -> None:
    """The command can start, and --out is this sweep's folder or a new one."""
    check_program(spec.command[0])
    record = folder.read_sweep()
    if record is not None and record["spec"]["command"] != spec.command:
        raise UsageError(f"{folder.root} holds another sweep (command: "
                         f"{' '.join(record['spec']['command'])}); choose another --out")
    if record is None and folder.root.is_dir() and any(folder.root.iterdir()):
        raise UsageError(f"--out {folder.root} already holds files that are not a sweep's; "
                         "multigpu never writes over them: choose another --out")


def runs_on(options: dict) -> str:
    where = str(options.get("on") or "local")
    if where not in ("local", "slurm"):
        raise UsageError(f"on: {where!r}: give local (this machine) or slurm")
    return where


def check_nodes(options: dict) -> int:
    """--nodes-per-run: a whole number of at least 1, and only with --on slurm (here is one
    machine); returns it (1 when not given)."""
    nodes = number_option(options, "nodes_per_run", int, 1, 1)
    if options.get("nodes_per_run") is not None and runs_on(options) != "slurm":
        raise UsageError(f"--nodes-per-run {options['nodes_per_run']}: runs of several nodes go "
                         "through SLURM, and this sweep runs on this one machine; add --on slurm, "
                         "or leave --nodes-per-run out")
    return nodes


def number_option(options: dict, key: str, kind, default, least):
    """An option from the flags or the file, as `kind`, at least `least`; else one line."""
    value = options.get(key)
    if value is None:
        return default
    try:
        number = kind(value)
        if isinstance(value, bool) or number < least:
            raise ValueError
    except (TypeError, ValueError):
        flag = "--" + key.replace("_", "-")
        raise UsageError(f"{flag} {value!r}: give a {'whole ' if kind is int else ''}number of "
                         f"at least {least}, e.g. {flag} {max(least, 1)}") from None
    return number


def check_program(program: str) -> None:
    """A command that cannot start fails here once, not once per run."""
    import shutil

    if program != "multigpu" and shutil.which(program) is None:
        where = "" if os.sep in program else " on PATH"
        raise UsageError(f"the command's program {program!r} is not found{where}; check its "
                         "spelling, or give its path (e.g. python3, ./train.sh)")


def default_per_run() -> str:
    from multigpu.launcher import devices

    try:
        return "1" if devices.visible_gpus(devices.query_gpus(), devices.user_cuda_visible()) else "cpu:1"
    except devices.NvmlUnavailable:
        return "cpu:1"


def parse_duration(text, flag: str = "--timeout") -> float | None:
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"{flag} {text}: give a time like 90s, 30m or 2h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]

