"""bench telemetry: NVML samples during a trial, folded per trial over devices and ranks, and the
notes a user reads when clocks were held down. NVML is faked: CI has no GPU."""
import threading

import pytest

from multigpu.bench import report, telemetry
from multigpu.bench.spec import Task


class FakeNvml:
    """Two GPUs; clocks and reasons come from per-handle queues (the last value repeats)."""

    def __init__(self, clocks, reasons, power_mw=(700_000,), temps=(60,)):
        self.clocks, self.reasons, self.power, self.temps = clocks, reasons, power_mw, temps
        self.calls = {h: 0 for h in clocks}
        self.lock = threading.Lock()
        self.fifth_sample = threading.Event()  # set once a handle's clock was read 5 times

    def _next(self, seq, h):
        return seq[min(self.calls[h], len(seq) - 1)]

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == 1, "the SM clock"
        with self.lock:
            value = self._next(self.clocks[h], h)
            self.calls[h] += 1
            if self.calls[h] >= 5:
                self.fifth_sample.set()
            return value

    def nvmlDeviceGetPowerUsage(self, h):
        return self.power[0]

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self.temps[0]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._next(self.reasons[h], h)


def test_a_trial_is_summarised_with_the_slowest_gpu_and_every_reason_seen():
    nv = FakeNvml(clocks={"a": [1980, 1980], "b": [1755, 1500]},
                  reasons={"a": [0x0], "b": [0x4]}, power_mw=(650_500,), temps=(71,))
    sampler = telemetry.Sampler(nv, ["a", "b"], interval=3600)  # only the start and stop samples
    sampler.start()
    summary = sampler.stop()
    assert summary == {"sm_mhz": 1628, "sm_mhz_min": 1500, "power_w": 650.5, "temp_c": 71,
                       "reasons": ["sw_power_cap"], "samples": 2}
    sampler.start()  # the next trial starts from no samples
    assert sampler.stop()["samples"] == 2


def test_the_thread_samples_while_the_trial_runs():
    nv = FakeNvml(clocks={"a": [1980]}, reasons={"a": [0]})
    sampler = telemetry.Sampler(nv, ["a"], interval=0.001)
    sampler.start()
    sampled = nv.fifth_sample.wait(timeout=30)
    summary = sampler.stop()
    assert sampled, f"5 samples at an interval of 1 ms did not come in 30 s: {nv.calls['a']}"
    assert summary["samples"] >= 5
    assert not any(t.name == "multigpu-telemetry" for t in threading.enumerate())


def test_a_query_the_driver_refuses_is_left_out():
    class NoPower(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, h):
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    sampler = telemetry.Sampler(NoPower(clocks={"a": [1400]}, reasons={"a": [0x8 | 0x1]}), ["a"],
                                interval=3600)
    sampler.start()
    assert sampler.stop() == {"sm_mhz": 1400, "sm_mhz_min": 1400, "power_w": None, "temp_c": 60,
                              "reasons": ["hw_slowdown", "idle"], "samples": 2}


def test_no_sampler_on_cpu():
    import torch

    assert telemetry.Sampler.for_devices([torch.device("cpu")]) is None


def _trial(mhz, low, reasons=()):
    return {"sm_mhz": mhz, "sm_mhz_min": low, "power_w": 600.0, "temp_c": 60,
            "reasons": list(reasons), "samples": 40}


def test_ranks_merge_per_trial_and_a_rank_without_telemetry_is_ignored():
    rank0 = [_trial(1980, 1965), _trial(1900, 1700, ["sw_power_cap"])]
    rank1 = [_trial(1950, 1900, ["idle"]), None]
    merged = telemetry.merge_ranks([rank0, rank1, None], trials=2)
    assert merged == [_trial(1950, 1900, ["idle"]), _trial(1900, 1700, ["sw_power_cap"])]
    assert telemetry.merge_ranks([None, []], trials=2) is None


def test_rows_carry_the_merged_telemetry_and_slowed_trials_become_a_note():
    task = Task("multigpu-ddp", "resnet50", 128, 2, 224, "bf16", "synthetic", 1000, 2, 10, 3)
    ranks = [{"kind": "task", "key": task.key, "rank": r, "seconds": [0.3, 0.3, 0.3],
              "samples": [2560] * 3, "memory_before": None, "peak_memory": None,
              "device_names": ["NVIDIA H200"], "setup_seconds": 1.0, "gpu_trials": trials}
             for r, trials in enumerate([
                 [_trial(1980, 1980), _trial(1700, 1410, ["sw_power_cap"]), _trial(1980, 1980)],
                 [_trial(1980, 1980), _trial(1980, 1980), _trial(1800, 1605, ["hw_thermal"])]])]
    row = report.build_row(task, ranks, None)
    assert [t["sm_mhz_min"] for t in row["trial_gpu"]] == [1980, 1410, 1605]
    assert telemetry.slowdown_notes([row]) == [
        "multigpu-ddp x2 resnet50 batch 128: GPU clocks held down (hw_thermal, sw_power_cap) in "
        "trials 2, 3 of 3; SM clock down to 1,410 MHz"]
    calm = report.build_row(task, [dict(r, gpu_trials=[_trial(1980, 1980, ["idle"])] * 3)
                                   for r in ranks], None)
    assert telemetry.slowdown_notes([calm]) == []
    noisy = report.build_row(task, [dict(c, seconds=[0.3, 0.4, 0.3]) for c in
                                    [dict(r, gpu_trials=[_trial(1980, 1965)] * 3) for r in ranks]],
                             None)
    other = dict(noisy, method="ddp", spread_pct=12.4)
    assert telemetry.slowdown_notes([noisy, other, calm]) == [
        "resnet50 batch 128 x2: the trials of 2 methods spread 12-25 % while no GPU clock was held "
        "down (lowest 1,965 MHz), so the time went elsewhere (host CPU, other jobs, waiting for a "
        "slower rank); min-max shows each one's worst and best trial"]
    real = dict(noisy, data="real")
    assert [n.split(":")[0] for n in telemetry.slowdown_notes([noisy, real])] == [
        "resnet50 batch 128 x2", "resnet50 batch 128 x2, real data"]
    alone = dict(noisy, method="multigpu-single", gpus=1)
    (note,) = telemetry.slowdown_notes([alone])
    assert note.startswith("resnet50 batch 128 x1: the trials of 1 method spread 25 %")
    assert "(host CPU, other jobs);" in note, "one process waits for no other rank"
    cpu = report.build_row(task, [dict(r, gpu_trials=None) for r in ranks], None)
    assert cpu["trial_gpu"] is None and telemetry.slowdown_notes([cpu]) == []


@pytest.mark.parametrize("mask,names", [(0, []), (0x1, ["idle"]),
                                        (0x4 | 0x40, ["sw_power_cap", "hw_thermal"])])
def test_reason_bits_have_names(mask, names):
    assert telemetry.reason_names(mask) == names


def test_a_trial_samples_between_its_first_and_last_step_and_stops_even_when_a_step_fails():
    import torch

    from multigpu.bench import measure

    events = []

    class Recorder:
        def start(self):
            events.append("start")

        def stop(self):
            events.append("stop")
            return _trial(1980, 1980)

    def step():
        events.append("step")
        if len(events) > 4:
            raise RuntimeError("CUDA error: an illegal memory access")
        return 8

    task = Task("multigpu-single", "mlp", 8, 1, 8, "fp32", "synthetic", 10, 0, 2, 2)
    run = measure.Run(task, measure.Prepared(step, [torch.device("cpu")]), [torch.device("cpu")],
                      None, 0.0, 0, sampler=Recorder())
    measure.time_trial(run)
    assert events == ["start", "step", "step", "stop"] and run.gpu_trials == [_trial(1980, 1980)]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        measure.time_trial(run)
    assert events[-1] == "stop", "the sampling thread is stopped when a step fails"
