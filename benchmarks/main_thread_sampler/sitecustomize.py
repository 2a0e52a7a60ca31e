"""A sampling profiler of a process's main thread, for benchmarks only (never imported by multigpu).

    PYTHONPATH=$PWD/benchmarks/main_thread_sampler:$PWD/src MAIN_THREAD_SAMPLES=/tmp/s \
        python -m multigpu train ...

Python imports this `sitecustomize` at every interpreter's start: the launcher, each rank and a
spawn or fork server (multiprocessing's helpers are left alone; a forked loader worker inherits no
thread). With MAIN_THREAD_SAMPLES set, a daemon thread wakes every MAIN_THREAD_PERIOD seconds
(0.005), takes the main thread's Python stack (sys._current_frames) and its scheduler state (R
running or runnable, S sleeping, D in the disk) from /proc/self/task/<pid>/stat, and appends them
each second to MAIN_THREAD_SAMPLES/samples-<pid>.jsonl: a {"stack": i, "frames": [...]} line for
each new stack (innermost first, "file:function:line"), then {"t0": unix time, "s": [[ms since t0,
state, stack], ...]}. benchmarks/main_thread_report.py reads them.
"""
import os
import sys

_DIR = os.environ.get("MAIN_THREAD_SAMPLES")


def _short(path: str) -> str:
    for cut in ("site-packages/", "/src/", "/lib/python3"):
        if cut in path:
            return path.rsplit(cut, 1)[1]
    return os.path.basename(path)


def _sample_forever(directory: str, period: float) -> None:
    import json
    import threading
    import time

    main, pid = threading.main_thread().ident, os.getpid()
    stat = f"/proc/self/task/{pid}/stat"
    out_path = os.path.join(directory, f"samples-{pid}.jsonl")
    stacks: dict[tuple, int] = {}
    new_stacks: list[str] = []
    batch: list = []
    t0 = time.time()
    flushed = time.monotonic()
    names = {}
    while True:
        time.sleep(period)
        frame = sys._current_frames().get(main)
        if frame is None:
            break
        try:
            with open(stat) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "?"
        key = []
        depth = 0
        while frame is not None and depth < 48:
            code = frame.f_code
            name = names.get(code)
            if name is None:
                name = names[code] = f"{_short(code.co_filename)}:{code.co_name}"
            key.append(f"{name}:{frame.f_lineno}")
            frame, depth = frame.f_back, depth + 1
        key = tuple(key)
        index = stacks.get(key)
        if index is None:
            index = stacks[key] = len(stacks)
            new_stacks.append(json.dumps({"stack": index, "frames": key}))
        batch.append([round((time.time() - t0) * 1000, 1), state, index])
        if time.monotonic() - flushed > 1.0:
            with open(out_path, "a") as f:
                for line in new_stacks:
                    f.write(line + "\n")
                f.write(json.dumps({"t0": t0, "argv": sys.argv[:4], "s": batch}) + "\n")
            new_stacks, batch, flushed = [], [], time.monotonic()
            t0 = time.time()


def _start() -> None:
    import threading

    os.makedirs(_DIR, exist_ok=True)
    period = float(os.environ.get("MAIN_THREAD_PERIOD", "0.005"))
    threading.Thread(target=_sample_forever, args=(_DIR, period), name="main-thread-sampler",
                     daemon=True).start()


if _DIR and not any("multiprocessing" in a or "forkserver" in a for a in sys.orig_argv):
    _start()
