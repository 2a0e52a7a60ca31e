"""Writes its pid to OUT_DIR/pid<RANK> and sleeps, to be interrupted."""
import os
import sys
import time

with open(os.path.join(sys.argv[1], f"pid{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
