"""Writes OUT/pid<RANK>; on SIGUSR1 writes OUT/usr1-<RANK> and exits; with `ignore`, goes on
through SIGTERM, and writes OUT/term-<RANK> at the first one (the test knows it arrived)."""
import os
import signal
import sys
import time

out, rank = sys.argv[1], os.environ["RANK"]


def on_usr1(*_):
    open(os.path.join(out, f"usr1-{rank}"), "w").close()
    sys.exit(0)


def on_term(*_):
    open(os.path.join(out, f"term-{rank}"), "a").close()


signal.signal(signal.SIGUSR1, on_usr1)
if sys.argv[2:] == ["ignore"]:
    signal.signal(signal.SIGTERM, on_term)
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)  # a handler that returns does not end it: the sleep goes on for what is left
