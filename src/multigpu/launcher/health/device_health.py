"""Which devices of a launch are unhealthy, asked when a rank has died (--min-devices, local_loop).

Three sources, each one's word enough to drop a device:
  - `--device-health CMD`: a site's own check (clusters' health scripts), run through the shell
    with MULTIGPU_DEVICES=cpu:0,cpu:1,... (this attempt's devices) in its environment; it prints
    the unhealthy devices, one per line or separated by commas or spaces, each as the run names
    it (`cuda:1` or `cpu:1`), by its index alone (`1`), or, for a GPU, by its UUID (`GPU-...`);
    nothing when all are well. GPU indices are those --devices takes (within a user's
    CUDA_VISIBLE_DEVICES). A command that fails (non-zero exit) or runs past HEALTH_TIMEOUT
    costs one warning line and names no device.
  - NVML on GPUs, by default (nvidia-ml-py): the GPU gone (NVML cannot get its handle: lost or
    not found), an Xid of the hardware's since the launch began (nvml_health.XID_HARDWARE),
    uncorrected ECC errors since the launch began, retired pages pending, a failed row remapping. A query the
    GPU does not support, or any other NVML error, says nothing: unknown is healthy.
  - The dead rank's own error (its torchelastic error file): a CUDA error of those classes
    (CUDA_HARDWARE: ECC uncorrectable, the GPU lost or fallen off the bus).
A rank that died of anything else (a crash that comes from the data recurs on any device) names
no device: the loop restarts on the same devices. CPU processes have no NVML: only CMD names one.
"""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HEALTH_TIMEOUT = 60.0  # s a --device-health command may take
DEVICES_ENV = "MULTIGPU_DEVICES"
CUDA_HARDWARE = re.compile(r"uncorrectable ECC error|ECC_UNCORRECTABLE|ECCUncorrectable|GPU is lost|"
                           r"fallen off the bus|uncontained|CUDA_ERROR_HARDWARE_STACK_ERROR",
                           re.IGNORECASE)


@dataclass(frozen=True)
class Device:
    """One device of a launch: `name` as the run says it (cpu:1, cuda:3: the id --devices takes);
    `token`: its entry in the ranks' CUDA_VISIBLE_DEVICES, `uuid`: NVML's GPU-... (GPUs only)."""
    name: str
    token: str = ""
    uuid: str = ""

    @property
    def index(self) -> str:
        return self.name.split(":", 1)[1]


@dataclass(frozen=True)
class Unhealthy:
    device: Device
    why: str  # "--device-health ./health.sh", "NVML: Xid 79"


def parse_named(text: str, devices: Sequence[Device]) -> tuple[list[Device], list[str]]:
    """The devices a health command's output names (in the run's order), and the words of it
    that name none of them."""
    named, unknown = set(), []
    for word in re.split(r"[\s,]+", "\n".join(ln for ln in text.splitlines()
                                               if not ln.lstrip().startswith("#"))):
        if not word:
            continue
        low = word.lower()
        found = [d for d in devices if low in (d.name, d.index, d.uuid.lower())
                 or (d.token and d.token.lower() == low and not d.token.isdigit())]
        if found:
            named.update(found)
        else:
            unknown.append(word)
    return [d for d in devices if d in named], unknown


def run_command(cmd: str, devices: Sequence[Device], warn: Callable[[str], None],
                timeout: float = HEALTH_TIMEOUT) -> list[Device]:
    """The devices `cmd` names unhealthy; a failure of the command itself: a warning, none."""
    env = {**os.environ, DEVICES_ENV: ",".join(d.name for d in devices)}
    try:
        done = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        warn(f"--device-health {cmd}: no answer in {timeout:g} s; taken as naming no device")
        return []
    except OSError as exc:
        warn(f"--device-health {cmd}: could not be run ({exc}); taken as naming no device")
        return []
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1][:200]
        warn(f"--device-health {cmd}: exit code {done.returncode}"
             + (f" ({last})" if last else "") + "; taken as naming no device")
        return []
    named, unknown = parse_named(done.stdout, devices)
    if unknown:
        warn(f"--device-health {cmd} named {', '.join(unknown[:5])}: not a device of this run "
             f"({', '.join(d.name for d in devices)}); ignored")
    return named


def from_errors(failures: dict, devices: Sequence[Device]) -> list[Unhealthy]:
    """The devices whose dead rank's error is a CUDA error of the hardware's (CUDA_HARDWARE)."""
    from multigpu.launcher.launch_failures import error_text

    found = []
    for rank, failure in failures.items():
        text = error_text(getattr(failure, "error_file_data", None) or {}) or ""
        if rank < len(devices) and (m := CUDA_HARDWARE.search(text)):
            found.append(Unhealthy(devices[rank], f"its rank's CUDA error: {m.group(0)}"))
    return found


class DeviceHealth:
    """What the loop asks after a rank's death: `unhealthy(devices, failures)`. Made when the
    launch starts (NVML's counts then are the baseline); close() at its end."""

    def __init__(self, command: str | None, devices: Sequence[Device], warn: Callable[[str], None]):
        from multigpu.launcher.health.nvml_health import NvmlHealth

        self.command, self.warn = command, warn
        gpus = [d for d in devices if d.name.startswith("cuda:")]
        self.nvml = NvmlHealth(gpus) if gpus else None

    def unhealthy(self, devices: Sequence[Device], failures: dict) -> list[Unhealthy]:
        found = from_errors(failures, devices)
        if self.nvml is not None:
            found += [Unhealthy(d, why) for d, why in self.nvml.unhealthy(devices)]
        if self.command:
            found += [Unhealthy(d, f"--device-health {self.command}")
                      for d in run_command(self.command, devices, self.warn)]
        first: dict[Device, Unhealthy] = {}
        for u in found:
            first.setdefault(u.device, u)
        return [first[d] for d in devices if d in first]

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
