"""One global batch on any device count: `setup(global_batch_size=G)` (`--global-batch-size G`).

An optimizer step trains G samples, whatever the number of devices D: each device takes G / D of
them, in `accumulate` micro-batches of `micro` samples (micro x accumulate = G / D). `micro` is
the largest divisor of G / D that is at most the loader's batch size (the largest per-device
batch that fits: `--batch-size`, or what `--batch-size auto` found), so accumulation makes up the
rest. Step k trains positions [k G, (k + 1) G) of the epoch's order on any D (multigpu.core.loading.data
shares them out) and the loss is averaged over them: 2, 3 or 4 devices reach the same weights, up
to the order of the floating-point sums (each rank sums its share, then the all-reduce sums the
ranks).

An epoch's last, smaller step (its n mod G samples, r): with drop_last dropped; otherwise trained
with the step before it, which then holds G + r samples (in more micro-batches of the same size).
That depends on G and the data alone: r kept as a step of its own could not be shared out on
every device count (r may be fewer than the devices). The sampler that plans the steps:
multigpu.core.loading.global_batch_sampler. This module imports no torch: `multigpu train` checks G
before its launch with it.
"""
from __future__ import annotations

from dataclasses import dataclass

from multigpu.core.errors import Api, Text, UsageError


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is made on this run's devices."""
    global_batch: int  # samples per optimizer step, over all devices
    devices: int       # devices sharing each step
    micro: int         # samples per device per micro-batch
    accumulate: int    # micro-batches per optimizer step
    largest: int       # the largest per-device batch allowed (the loader's batch size)

    def describe(self) -> str:
        per = "device" if self.devices == 1 else f"device x {self.devices} devices"
        return (f"{self.micro} per {per} x {self.accumulate} micro-batch"
                + ("es" if self.accumulate > 1 else ""))


def _best_micro(share: int, largest: int) -> int:
    """The largest divisor of `share` that is at most `largest`."""
    return max(d for d in range(1, min(share, largest) + 1) if share % d == 0)


def _works(global_batch: int, devices: int, largest: int) -> bool:
    """Whether G shares out evenly and into micro-batches more than half as large as they may
    be (17 per device where 16 fit would be 17 micro-batches of 1: 16 x the steps' time)."""
    if global_batch < devices or global_batch % devices:
        return False
    share = global_batch // devices
    return 2 * _best_micro(share, largest) > min(share, largest)


def nearest_working(global_batch: int, devices: int, largest: int) -> list[int]:
    """The nearest global batches below and above `global_batch` that this run can make."""
    found = []
    below = next((g for g in range(global_batch - 1, devices - 1, -1)
                  if _works(g, devices, largest)), None)
    if below is not None:
        found.append(below)
    above = global_batch + 1
    while not _works(above, devices, largest):  # a multiple of devices x largest always works
        above += 1
    return [*found, above]


def check_global_batch(global_batch: int | None, accumulate: int) -> None:
    """setup()'s check: a global batch of 1 or more, and never beside an accumulation of its own."""
    if global_batch is None:
        return
    if global_batch < 1:
        raise UsageError(f"global_batch_size={global_batch} must be 1 or more")
    if accumulate != 1:
        given = Api("setup.global_batch_size", global_batch)
        raise UsageError(Text("{} and {} both set the accumulation: give {} alone (it chooses the "
                              "accumulation from the devices)",
                              Api("setup.accumulate", accumulate), given, given))


def plan_batch(global_batch: int, devices: int, largest: int) -> BatchPlan:
    """The plan of G on `devices` devices with per-device batches of at most `largest`; a G
    that cannot be made is refused naming the nearest that can."""
    if global_batch < 1:
        raise UsageError(f"global_batch_size={global_batch} must be 1 or more")
    given = Api("setup.global_batch_size", global_batch)
    if _works(global_batch, devices, largest):
        share = global_batch // devices
        micro = _best_micro(share, largest)
        return BatchPlan(global_batch, devices, micro, share // micro, largest)
    choices = [Api("setup.global_batch_size", g) for g in nearest_working(global_batch, devices, largest)]
    either = " or ".join("{}" for _ in choices)
    if global_batch < devices or global_batch % devices:
        why, names = (f"cannot be shared out evenly over this run's {devices} devices (each takes "
                      "the same number of samples)"), ()
    else:
        share = global_batch // devices
        micro = _best_micro(share, largest)
        why = (f"is {share} samples per device on {devices} device{'s' if devices > 1 else ''}, "
               f"which splits only into {share // micro} micro-batches of {micro} where {{}} "
               f"allows {largest}")
        names = (Api("DataLoader.batch_size", text="the batch size"),)
    raise UsageError(Text(f"{{}} {why}: give {either}", given, *names, *choices))
