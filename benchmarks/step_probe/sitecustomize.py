"""Times every optimizer step of any PyTorch script, ours or a peer's, with no change to it: put this
folder first on PYTHONPATH and set STEP_PROBE=/path/prefix. Each process launched with a RANK (the
workers torchrun starts) writes PREFIX-rankN.json at exit: the host's seconds between consecutive
optimizer steps (torch's global step post hook), median and quartiles over the steps after the
first SKIP (default 50). STEP_PROBE_PROFILE=1 also profiles steps SKIP..SKIP+60 with
torch.profiler (CPU and CUDA) into PREFIX-rankN.txt: the ops by host time and by GPU time, and the
count of each, so host syncs and extra launches per step can be compared between two scripts.
"""
import os

if os.environ.get("STEP_PROBE") and os.environ.get("RANK") is not None:
    import atexit
    import json
    import statistics
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _prefix, _rank = os.environ["STEP_PROBE"], os.environ["RANK"]
    _skip = int(os.environ.get("STEP_PROBE_SKIP", "50"))
    _times: list[float] = []
    _profile = None
    if os.environ.get("STEP_PROBE_PROFILE"):
        from torch.profiler import ProfilerActivity, profile, schedule

        def _write_profile(p) -> None:
            averages = p.key_averages()
            with open(f"{_prefix}-rank{_rank}.txt", "w") as f:
                f.write(averages.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=60))
                f.write("\n")
                f.write(averages.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60))

        _profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                           schedule=schedule(wait=_skip, warmup=5, active=60, repeat=1),
                           on_trace_ready=_write_profile)

    def _on_step(*_args) -> None:
        _times.append(time.perf_counter())
        if _profile is not None:
            if len(_times) == 1:
                _profile.start()
            elif len(_times) <= _skip + 66:
                _profile.step()
            if len(_times) == _skip + 66:
                _profile.stop()

    register_optimizer_step_post_hook(_on_step)

    def _write_times() -> None:
        gaps = [b - a for a, b in zip(_times, _times[1:])][_skip:]
        if len(gaps) < 4:
            return
        q = statistics.quantiles(gaps, n=4)
        with open(f"{_prefix}-rank{_rank}.json", "w") as f:
            json.dump({"steps": len(_times), "timed": len(gaps), "median_ms": round(statistics.median(gaps) * 1e3, 3),
                       "q1_ms": round(q[0] * 1e3, 3), "q3_ms": round(q[2] * 1e3, 3)}, f)

    atexit.register(_write_times)
