"""`multigpu sweep --status DIR`: where a sweep stands, read from its folder (no lock needed).

    sweep sweeps/ts: 18 runs: 9 done, 2 running, 1 failed, 6 pending; running (pid 4242)
    elapsed 12m 04s, about 9m 30s left
    best so far: data=timeseries:co2, seq_length=40, future_length=1: val_mae 0.3412
    then a table: run, status, time, attempts, final and best metric, note
"""
from __future__ import annotations

import statistics
import time

from multigpu.sweep.state import RunState, SweepFolder, format_duration
from multigpu.sweep.summary import sort_results, split_metric


def render(folder: SweepFolder, sweep) -> str:
    """The status report of `sweep` (a scheduler.Sweep built from the folder's sweep.json)."""
    states = sweep.states()
    holder = folder.holder_pid()
    counts = {s: sum(st.status == s for st in states) for s in ("done", "running", "failed", "stopped", "pending")}
    if holder is None:  # nobody runs them: a "running" state is left from a killed sweep
        counts["stopped"] += counts.pop("running")
        who = ("complete" if counts["done"] == len(states) else
               f"not running (run the same command again, or multigpu sweep --resume {folder.root}, "
               "to go on)")
    else:
        who = f"running (pid {holder})"
    parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines = [f"sweep {folder.root}: {len(states)} runs: {parts}; {who}"]
    record = folder.read_sweep() or {}
    started = record.get("started")
    if started and holder is not None:
        left = _time_left(states, record.get("slots") or 1)
        lines.append(f"elapsed {format_duration(time.time() - started)}"
                     + (f", about {format_duration(left)} left" if left is not None else ""))
    results = [sweep.result(st) for st in states]
    metric = sweep.metric()
    _, higher = split_metric(metric)
    ranked = [r for r in sort_results(results, higher) if r.best is not None]
    if ranked:
        best = ranked[0]
        label = ", ".join(f"{k}={v}" for k, v in best.params.items())
        lines.append(f"best so far: {label}: {metric} {best.best:.4g}")
    lines.append("")
    lines.append(f"{'run':<44} {'status':<8} {'time':>8} {'tries':>5} {'final':>9} {'best':>9}  note")
    for r in results:
        status = "stopped" if r.status == "running" and holder is None else r.status
        lines.append(f"{r.name[:44]:<44} {status:<8} {format_duration(r.duration_s):>8} {r.attempts:>5} "
                     f"{_num(r.final):>9} {_num(r.best):>9}  {r.note[:80]}")
    lines.append(f"\n({metric}: {'higher' if higher else 'lower'} is better; "
                 f"log: {folder.log_path})")
    return "\n".join(lines)


def _time_left(states: list[RunState], slots: int) -> float | None:
    done = [st.duration_s for st in states if st.status == "done" and st.duration_s]
    if not done:
        return None
    mean = statistics.mean(done)
    running = sum(max(0.0, mean - (st.duration_s or 0)) for st in states if st.status == "running")
    waiting = sum(st.status in ("pending", "stopped") for st in states)
    return running / max(1, slots) + waiting * mean / max(1, slots)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
