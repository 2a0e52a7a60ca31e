"""Imported first by the sweep's fork server (starter.SERVER_FIRST), and only there: the server dies
the moment the sweep does.

The runs forked from the server learn that their sweep is gone from the server's death: each has
asked for SIGTERM when its parent goes (PR_SET_PDEATHSIG), and its parent is the server, not the
sweep. Left to itself, the server sees a sweep killed with -9 at once (its pipe from the sweep
closes) but then exits as Python does, tearing down the torch, dynamo and matplotlib it preloaded
first: about a second of CPU on an idle machine, several on a loaded one, while the runs train on
and `--status` finds no sweep. So the server asks the kernel for SIGKILL when the sweep dies, as an
exec'd run asks for SIGTERM: it holds nothing worth saving, and its runs then get their SIGTERM
when the sweep dies, as an exec'd run does.

The signal comes when the thread that started the server exits: the sweep's main thread (its
scheduler loop), which lives as long as the sweep.
"""
from __future__ import annotations

import os
import signal

from multigpu.core.system.orphans import set_death_signal
from multigpu.sweep.starter import SWEEP_PID_ENV


def die_with_the_sweep() -> None:
    """SIGKILL when the sweep that started this server dies; gone at once if it already has. A
    process without SWEEP_PID_ENV (not a sweep's server) is left alone."""
    try:
        sweep = int(os.environ.pop(SWEEP_PID_ENV, ""))
    except ValueError:
        return
    set_death_signal(signal.SIGKILL)
    if os.getppid() != sweep:  # the sweep died before the line above: no signal would come
        os._exit(1)


die_with_the_sweep()
