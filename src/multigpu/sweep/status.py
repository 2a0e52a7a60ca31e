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

SHOWN = ("done", "running", "stopping", "failed", "stopped", "pending")


def render(folder: SweepFolder, sweep) -> str:
    """The status report of `sweep` (a scheduler.Sweep built from the folder's sweep.json)."""
    states = sweep.states()
    holder = folder.holder_pid()
    record = folder.read_sweep() or {}
    shown, notes, who = _shown(folder, states, record, holder)
    counts = {s: sum(v == s for v in shown.values()) for s in SHOWN}
    if who is None:
        who = ("complete" if counts["done"] == len(states) else
               f"not running (run the same command again, or multigpu sweep --resume {folder.root}, "
               "to go on)")
    parts = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines = [f"sweep {folder.root}: {len(states)} runs: {parts}; {who}"]
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
        lines.append(f"{'best' if who == 'complete' else 'best so far'}: {label}: {metric} {best.best:.4g}")
    lines.append("")
    width = max([3] + [len(r.name) for r in results])  # whole names: the varying key is last
    lines.append(f"{'run':<{width}} {'status':<8} {'time':>8} {'tries':>5} {'final':>9} {'best':>9}  note")
    for r in results:
        status = shown[r.name]
        note = notes.get(r.name, r.note)
        lines.append(f"{r.name:<{width}} {status:<8} {format_duration(r.duration_s):>8} {r.attempts:>5} "
                     f"{_num(r.final):>9} {_num(r.best):>9}  {note[:80]}")
    lines.append(f"\n({metric}: {'higher' if higher else 'lower'} is better; "
                 f"log: {folder.log_path})")
    return "\n".join(lines)


def _shown(folder: SweepFolder, states: list[RunState], record: dict, holder: int | None):
    """Each run's status as shown ({name: status}), notes that replace a run's own, and the end of
    the first line (None: from the counts). A "running" state nobody runs any more is left from a
    sweep that died: "stopped" once no process of the run lives, "stopping" (with its pid) while
    one does (it got SIGTERM when the sweep died); starting the same command again then refuses."""
    running = {st.name for st in states if st.status == "running"}
    shown = {st.name: st.status for st in states}
    if (record.get("options") or {}).get("on") == "slurm":  # its pids are on other machines
        live, who = _on_slurm(folder, states)
        shown.update({n: "stopped" for n in running if live is not None and _job(states, n) not in live})
        return shown, {}, who
    if holder is not None:
        return shown, {}, f"running (pid {holder})"
    pids = {st.name: st.pid for st in states if st.name in running and folder.run_lives(st)}
    shown.update({n: "stopping" if n in pids else "stopped" for n in running})
    notes = {n: f"pid {pid} is stopping (its sweep is gone)" for n, pid in pids.items()}
    if not pids:
        return shown, notes, None
    one = len(pids) == 1
    return shown, notes, (f"not running, but {len(pids)} run{'' if one else 's'} of it "
                          f"{'is' if one else 'are'} still stopping (pid "
                          f"{', '.join(map(str, pids.values()))}): wait for {'it' if one else 'them'} "
                          "before running the same command again")


def _job(states: list[RunState], name: str) -> str:
    return next(st.job for st in states if st.name == name)


def _on_slurm(folder: SweepFolder, states: list[RunState]) -> tuple[set | None, str]:
    """(the sweep's array tasks SLURM still has, or None without squeue; the status line's end)."""
    from multigpu.sweep.slurm import queued

    live = queued(folder)
    if live is None:
        return None, "on SLURM (squeue does not answer here: states as the runs last wrote them)"
    mine = sum(st.job in live for st in states if st.status != "done")
    if mine:
        return live, f"on SLURM: {mine} queued or running"
    if all(st.status == "done" for st in states):
        return live, "complete"
    return live, "not on SLURM's queue (run the same command again to submit the rest)"


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
