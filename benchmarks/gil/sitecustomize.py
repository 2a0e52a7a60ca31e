"""For benchmarks/decode_check.sh's GIL test only: with this folder on PYTHONPATH, every Python
process started sets the interpreter's thread switch interval to $BENCH_SWITCH_INTERVAL seconds
(default 0.005), so that a thread waiting for the GIL gets it sooner. It tests whether the GPU
decode thread's Python slows the training thread by holding the GIL."""
import os
import sys

_interval = os.environ.get("BENCH_SWITCH_INTERVAL")
if _interval:
    sys.setswitchinterval(float(_interval))
    _mark = os.environ.get("BENCH_SWITCH_MARK")
    if _mark:
        with open(_mark, "a") as f:
            f.write(f"{os.getpid()} {sys.getswitchinterval()}\n")
