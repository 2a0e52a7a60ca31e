"""Writes OUT/pid<RANK>; on SIGUSR1 writes OUT/usr1-<RANK> and exits; with `ignore`, ignores SIGTERM."""
import os
import signal
import sys
import time

out, rank = sys.argv[1], os.environ["RANK"]


def on_usr1(*_):
    open(os.path.join(out, f"usr1-{rank}"), "w").close()
    sys.exit(0)


signal.signal(signal.SIGUSR1, on_usr1)
if sys.argv[2:] == ["ignore"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
