"""Keep one physical core for a training process's main thread, its loader workers elsewhere: for
benchmarks only (never imported by multigpu), to measure the effect before the product does it.

    PYTHONPATH=$PWD/benchmarks/cpu_pin:$PWD/src CPU_PIN=1 python -m multigpu train ...

Python imports this `sitecustomize` at every interpreter's start. With CPU_PIN=1 (taken out of the
environment at once, so that processes started from this one are left alone), the main thread is
pinned to the first allowed CPU and its hyperthread siblings (/sys/.../thread_siblings_list; a CPU
without siblings keeps the next one too: 2 CPUs for the main and autograd threads, which a thread
started later from the main one inherits), and every process forked from this one (DataLoader
workers) to the other allowed CPUs (os.register_at_fork). CPU_PIN_REPORT=FILE: one line saying
which CPUs each got.
"""
import os


def _siblings(cpu: int) -> set[int]:
    try:
        text = open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read().strip()
    except OSError:
        return {cpu}
    found = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        found.update(range(int(lo), int(hi or lo) + 1))
    return found


def _pin() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    kept = _siblings(allowed[0]) & set(allowed)
    if len(kept) < 2 and len(allowed) > 2:
        kept.add(allowed[1])
    rest = set(allowed) - kept
    if not rest:
        return
    os.sched_setaffinity(0, kept)
    os.register_at_fork(after_in_child=lambda: os.sched_setaffinity(0, rest))
    report = os.environ.pop("CPU_PIN_REPORT", None)
    if report:
        with open(report, "a") as f:
            f.write(f"pid {os.getpid()}: main on {sorted(kept)}, forked children on {sorted(rest)}\n")


if os.environ.pop("CPU_PIN", None) == "1" and hasattr(os, "sched_setaffinity"):
    _pin()
