"""What the GPUs ran at during each timed trial: SM clock, power, temperature and NVML's reasons for
holding the clocks down, sampled through NVML (nvidia-ml-py) on a thread while the trial runs.

Why: on the 4x H200 machines one configuration ran 27 % faster at the end of a 3-minute stage than
at its start, and 4-GPU trials of one invocation spread by up to 22 % while 1-GPU trials spread by
0.3 %. A trial's figure can only be trusted, or explained, with the clocks it ran at.

Per process and trial, `Sampler.stop()` gives one summary over the devices the task uses:
    {"sm_mhz": mean SM clock of the slowest device, "sm_mhz_min": lowest sample,
     "power_w": highest mean power draw, "temp_c": highest temperature,
     "reasons": sorted names of every clock-event reason seen, "samples": how many}
`merge_ranks` folds the ranks' summaries of each trial into one, the same way; `slowdown_notes`
turns trials held down by power or heat into report notes, and names rows whose trials spread
widely at full clocks. Samples are taken every 20 ms (more slowly when the GIL is busy), one just
before the first step and one just after the last; an NVML query costs tens of microseconds and
ctypes releases the GIL while it waits, so the thread takes little from the step it measures.
"""
from __future__ import annotations

import threading

import torch

from multigpu.bench.spec import data_note

INTERVAL_S = 0.02
# nvmlClocksEventReasons bits (nvml.h). "idle" shows between kernels and means nothing here.
REASONS = {0x1: "idle", 0x2: "app_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake",
           0x100: "display_clocks"}
SLOWDOWNS = ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
_CLOCK_SM = 1  # NVML_CLOCK_SM
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU


def reason_names(mask: int) -> list[str]:
    return [name for bit, name in REASONS.items() if mask & bit]


class Sampler:
    """Samples `handles` (NVML device handles) from `start()` to `stop()` on a daemon thread."""

    def __init__(self, nvml, handles: list, interval: float = INTERVAL_S):
        self.nvml, self.handles, self.interval = nvml, handles, interval
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        self._samples: list[list[dict]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_devices(cls, devices: list[torch.device]) -> Sampler | None:
        """A sampler for the task's CUDA devices; None on CPU, without NVML, or when a device
        cannot be matched to an NVML handle (the bench runs on without telemetry)."""
        cuda = [d for d in devices if d.type == "cuda"]
        if not cuda:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()  # reference-counted by NVML; never shut down in a bench worker
            handles = [nvml_handle(pynvml, d) for d in cuda]
        except Exception:  # ImportError, NVMLError: no telemetry, the timing is unaffected
            return None
        return None if any(h is None for h in handles) else cls(pynvml, handles)

    def start(self) -> None:
        self._samples = [[] for _ in self.handles]
        self._stop.clear()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="multigpu-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> dict | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a hung NVML call must not hold up the bench
            self._thread = None
        self._sample()
        per_device = [summarize(s) for s in self._samples]
        return merge([d for d in per_device if d is not None])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        for h, out in zip(self.handles, self._samples):
            out.append(self._read(h))

    def _read(self, h) -> dict:
        nv, s = self.nvml, {}
        for key, read in (("sm_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, _CLOCK_SM)),
                          ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                          ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, _TEMPERATURE_GPU)),
                          ("reasons", lambda: int(self._reasons(h)) if self._reasons else None)):
            try:
                s[key] = read()
            except Exception:  # a query this GPU or driver does not support: leave it out
                pass
        return s


def nvml_handle(nvml, device: torch.device):
    """The NVML handle of a CUDA device, by UUID, else by PCI address (CUDA and NVML may number
    GPUs differently, and CUDA_VISIBLE_DEVICES renumbers them); None when neither matches."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:
            pass
    try:
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return nvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:
        return None


def summarize(samples: list[dict]) -> dict | None:
    """One device's samples of one trial -> its summary (see the module docstring)."""
    def values(key: str) -> list:
        return [s[key] for s in samples if s.get(key) is not None]

    clocks, power, temps = values("sm_mhz"), values("power_w"), values("temp_c")
    if not clocks:
        return None
    mask = 0
    for m in values("reasons"):
        mask |= m
    return {"sm_mhz": round(sum(clocks) / len(clocks)), "sm_mhz_min": min(clocks),
            "power_w": round(sum(power) / len(power), 1) if power else None,
            "temp_c": max(temps) if temps else None, "reasons": reason_names(mask),
            "samples": len(clocks)}


def merge(summaries: list[dict]) -> dict | None:
    """Summaries of one trial on several devices or ranks -> one: the slowest clock, the highest
    power and temperature, every reason seen. None when there is nothing to merge."""
    if not summaries:
        return None

    def pick(key: str, fn):
        vals = [s[key] for s in summaries if s.get(key) is not None]
        return fn(vals) if vals else None

    return {"sm_mhz": pick("sm_mhz", min), "sm_mhz_min": pick("sm_mhz_min", min),
            "power_w": pick("power_w", max), "temp_c": pick("temp_c", max),
            "reasons": sorted({r for s in summaries for r in s.get("reasons") or []}),
            "samples": pick("samples", min)}


def merge_ranks(per_rank: list[list[dict | None] | None], trials: int) -> list[dict | None] | None:
    """Each rank's per-trial summaries -> one per trial; None when no rank had telemetry."""
    ranks = [r for r in per_rank if r]
    if not ranks:
        return None
    return [merge([r[i] for r in ranks if i < len(r) and r[i]]) for i in range(trials)]


NOISY_SPREAD_PCT = 10.0  # trials of one row further apart than this get a note


def slowdown_notes(rows: list[dict]) -> list[str]:
    """A note per row whose trials ran with clocks held down by power or heat; and one per set of
    rows (same model, batch, GPU count) whose trials spread widely while the clocks were not held
    down, since then the cause was elsewhere."""
    notes, noisy = [], {}
    for row in rows:
        trials = row.get("trial_gpu") or []
        slowed = [(i + 1, t) for i, t in enumerate(trials)
                  if t and set(t["reasons"]) & set(SLOWDOWNS)]
        if slowed:
            why = sorted({r for _, t in slowed for r in t["reasons"] if r in SLOWDOWNS})
            lowest = min(t["sm_mhz_min"] for _, t in slowed)
            notes.append(f"{row['method']} x{row['gpus']} {row['model']} batch {row['batch_size']}: "
                         f"GPU clocks held down ({', '.join(why)}) in trial"
                         f"{'s' if len(slowed) > 1 else ''} {', '.join(str(i) for i, _ in slowed)}"
                         f" of {len(trials)}; SM clock down to {lowest:,} MHz")
        elif trials and all(trials) and (row.get("spread_pct") or 0) > NOISY_SPREAD_PCT:
            key = (row["model"], row["batch_size"], row["gpus"], row.get("data"))
            noisy.setdefault(key, []).append(row)
    for (model, batch, gpus, data), group in noisy.items():
        spreads = [r["spread_pct"] for r in group]
        low = min(t["sm_mhz_min"] for r in group for t in r["trial_gpu"])
        who = "1 method" if len(group) == 1 else f"{len(group)} methods"
        span = (f"{spreads[0]:.0f} %" if len(group) == 1
                else f"{min(spreads):.0f}-{max(spreads):.0f} %")
        where = "host CPU, other jobs" + (", waiting for a slower rank" if gpus > 1 else "")
        kind = data_note(data)
        notes.append(f"{model} batch {batch} x{gpus}{kind}: the trials of {who} spread {span} while no "
                     f"GPU clock was held down (lowest {low:,} MHz), so the time went elsewhere "
                     f"({where}); min-max shows each one's worst and best trial")
    return notes
