"""A lost device: go on without it (--max-restarts N --min-devices M [--device-health CMD]).

When a rank dies and restarts are left, the loop (local_loop) asks device_health which devices of
the attempt are unhealthy. None named: the same devices again, as without --min-devices (a crash
that comes from the data recurs on any device: it must not drop a healthy one). Some named, and
at least M healthy left: the next attempt runs on the healthy ones only (fewer ranks, the
CUDA_VISIBLE_DEVICES of those), from the newest checkpoint as every restart of `multigpu train`
does; the restart line names what was dropped, the count now, and what the caller's `reshape`
adds (multigpu train: the global batch kept, or the nearest the count can make). Fewer than M
left: one line, and no restart. One machine only: several nodes restart on the same devices.

The end of the launch says, for each restart, the time from the failure (the rank's death seen
by the launcher) to the first optimizer step of the next attempt, and the steps trained twice
(those the failed attempt had done after the checkpoint the next one resumed from), as rank 0
of each attempt recorded them (rank.step_record).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from multigpu.launcher.health.device_health import Device, DeviceHealth, Unhealthy
from multigpu.launcher.rank import step_record


@dataclass
class LostDevices:
    """--min-devices' policy, for local_loop. `reshape(n)`: the command for n devices, or None
    for the same, and what the restart line adds about it."""
    min_devices: int
    health: DeviceHealth
    reshape: Callable[[int], tuple[list[str] | None, str]] | None = None


@dataclass(frozen=True)
class NextAttempt:
    devices: tuple[Device, ...]
    cmd: list[str] | None  # None: the command as before
    on: str  # what the restart line says of where: "" for the same devices
    dropped: tuple[Device, ...] = ()
    extra: str = ""  # what it adds after the restart's number (reshape's words)


@dataclass
class Restart:
    """One restart of the launch, for the closing figures."""
    number: int  # 1 for the first
    failed_at: float  # time.time() the launcher saw the rank's death
    dropped: tuple[str, ...] = ()
    devices: int = 0  # how many the next attempt runs on


@dataclass
class Stop:
    line: str


def _names(devices: Sequence[Device]) -> str:
    return ", ".join(d.name for d in devices)


def _why(found: Sequence[Unhealthy]) -> str:
    whys = {u.why for u in found}
    said = _names([u.device for u in found])
    verb = "is" if len(found) == 1 else "are"
    return f"{said} {verb} unhealthy ({'; '.join(sorted(whys))})"


def next_attempt(lost: LostDevices, devices: Sequence[Device], failures: dict) -> NextAttempt | Stop:
    """Where the attempt after a failure runs, or why none runs."""
    found = lost.health.unhealthy(devices, failures)
    if not found:
        return NextAttempt(tuple(devices), None, "")
    bad = {u.device for u in found}
    healthy = tuple(d for d in devices if d not in bad)
    if len(healthy) < lost.min_devices:
        return Stop(f"{_why(found)}: {len(healthy)} healthy device{'s' if len(healthy) != 1 else ''}"
                    f" left{f' ({_names(healthy)})' if healthy else ''}, fewer than --min-devices "
                    f"{lost.min_devices}; not restarted")
    cmd, words = lost.reshape(len(healthy)) if lost.reshape is not None else (None, "")
    n = len(healthy)
    return NextAttempt(healthy, cmd,
                       f"{_why(found)}: dropped; restarting on the {n} healthy device"
                       f"{'s' if n != 1 else ''} ({_names(healthy)}) from the newest checkpoint",
                       tuple(d for d in devices if d in bad), words)


def devices_of(plan) -> tuple[Device, ...]:
    """The device of each local rank of a launch's DevicePlan: cpu:0.. for CPU processes, the
    GPUs by their ids (cuda:0, ...) with their CUDA_VISIBLE_DEVICES entries and UUIDs; () for one process
    that drives several GPUs (nothing to drop)."""
    if plan.accelerator == "cpu":
        return tuple(Device(f"cpu:{i}") for i in range(plan.nproc))
    if plan.nproc != len(plan.gpu_ids):
        return ()
    tokens = plan.tokens or tuple(str(i) for i in plan.gpu_ids)
    uuids = plan.uuids or ("",) * len(plan.gpu_ids)
    return tuple(Device(f"cuda:{i}", t, u) for i, t, u in zip(plan.gpu_ids, tokens, uuids))


@contextlib.contextmanager
def lost_device_policy(run):
    """The LostDevices of a launch (launch_common.LaunchRun) with --min-devices, for the length
    of it (NVML held); None without."""
    if run.opts.min_devices is None:
        yield None
        return
    from multigpu.launcher.launch_failures import err

    health = DeviceHealth(run.opts.device_health, devices_of(run.plan),
                          lambda line: err(f"warning: {line}"))
    try:
        yield LostDevices(run.opts.min_devices, health, run.reshape)
    finally:
        health.close()


@dataclass
class Recovery:
    """The closing figures of one restart; None where an attempt recorded no step."""
    restart: Restart
    seconds: float | None  # from the failure to the next attempt's first step
    twice: int | None  # optimizer steps trained twice
    samples: int | None = None  # samples trained twice


def recoveries(log_dir: str, restarts: Sequence[Restart], since: float) -> list[Recovery]:
    """From the attempts' step records written after `since` (the launch's start: a record left
    by an earlier launch in the same folder is not this one's). Steps trained twice: the samples
    the failed attempt had trained past the point the next one resumed from, in its steps. No figures
    for a restart of which neither attempt recorded a step."""
    def reached(attempt: int):
        r = step_record.read(log_dir, attempt)
        return r if r is not None and r.first_step_at >= since else None

    out = []
    for r in restarts:
        before, after = reached(r.number - 1), reached(r.number)
        if before is None and after is None:  # ranks that record no steps (a script of `run`)
            continue
        seconds = after.first_step_at - r.failed_at if after is not None else None
        twice = samples = None
        if before is not None and after is not None and before.step_samples():
            samples = max(before.reached - after.start, 0)
            twice = round(samples / before.step_samples())
        out.append(Recovery(r, seconds, twice, samples))
    return out


def recovery_line(rec: Recovery) -> str:
    r = rec.restart
    what = (f" ({', '.join(r.dropped)} dropped: on {r.devices} device{'s' if r.devices != 1 else ''})"
            if r.dropped else "")
    took = (f"{rec.seconds:.1f} s from the failure to the first resumed step"
            if rec.seconds is not None else "no step trained after it")
    twice = "" if rec.twice is None else (
        f"; {rec.twice} step{'s' if rec.twice != 1 else ''} trained twice ({rec.samples} samples "
        "trained before the failure past the checkpoint resumed from)")
    return f"recovery: restart {r.number}{what}: {took}{twice}"
