"""Where a run came from, for its config.json: the command, the code, the software and the machine.

    launch_facts(command)   in the process the user started: command line, folder, start time,
                            git commit; handed to the workers through LAUNCH_ENV
    run_facts(rt, launch)   in every worker (collective): versions, hostname, every rank's GPU

Also `multigpu --version`, which reads installed package metadata and never imports torch.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from importlib import metadata

LAUNCH_ENV = "MULTIGPU_LAUNCH"  # set by `multigpu train` for the workers it launches
GIT_TIMEOUT_S = 5


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    ours = installed_version("multigpu") or getattr(sys.modules.get("multigpu"), "__version__",
                                                    "unknown")
    torch = installed_version("torch") or "not installed"
    return f"multigpu {ours} (torch {torch}, Python {sys.version.split()[0]})"


class PrintVersion(argparse.Action):
    """`--version`: the line above, then exit (argparse's own version action wants the text when
    the parser is built, which would cost every command the metadata lookup)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def launch_facts(command: list[str], folder: str | None = None) -> dict:
    """What only the launching process knows: the command as typed, where, when, which commit."""
    folder = os.path.abspath(folder or os.getcwd())
    facts = {"command": shlex.join(command), "cwd": folder,
             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    git = git_state(folder)
    if git is not None:
        facts["git"] = git
    return facts


def git_state(folder: str) -> dict | None:
    """{"commit": ..., "dirty": ...} of the git work tree holding `folder`; None without git or
    outside a repository. Dirty: tracked files changed (the run folders a run writes are untracked
    and do not count)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True,
                                  timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def to_env(facts: dict) -> dict[str, str]:
    return {LAUNCH_ENV: json.dumps(facts)}


def from_env() -> dict:
    """The launching process's facts, in a worker; {} when started some other way."""
    try:
        facts = json.loads(os.environ.get(LAUNCH_ENV, "{}"))
    except ValueError:
        return {}
    return facts if isinstance(facts, dict) else {}


def run_facts(rt, launch: dict) -> dict:
    """config.json's "provenance": `launch` and the software and machine. Collective: every rank
    tells which GPUs it drives."""
    from multigpu.launcher import sysinfo

    torch_facts = sysinfo.torch_facts()

    def known(key: str) -> str | None:
        value = torch_facts.get(key)
        # plain str: torch's version is a str subclass that weights_only loading refuses
        return None if value in (None, "None", "not available", "not installed") else str(value)

    gpus = rt.env.all_gather_object(_gpu_names(rt))
    return {**launch, "hostname": socket.gethostname(),
            "multigpu": installed_version("multigpu") or sys.modules["multigpu"].__version__,
            "python": sys.version.split()[0], "torch": known("torch"),
            "cuda": known("CUDA (torch built with)"), "cudnn": known("cuDNN"),
            "nccl": known("NCCL"),
            "gpus": [name for names in gpus for name in names]}


def _gpu_names(rt) -> list[str]:
    if rt.device.type != "cuda":
        return []
    import torch

    return [torch.cuda.get_device_name(d) for d in rt.strategy.devices]
