"""flock, the one way multigpu locks a file or a folder between processes.

Device leases (launcher/leases.py), the users of a run folder and its claims
(train/rundir/folder_users.py), a checkpoint folder's one writer (train/checkpoints/checkpoint_store.py) and a
sweep's folder (sweep/state.py) each lock an open descriptor with `lock()`; each caller keeps its
own file, what it writes into it and what it says when another process holds it.

Why flock on a descriptor, not the `filelock` package (a torch dependency, so always installed):
a lock here is often held on a folder itself (O_DIRECTORY), shared by several holders (LOCK_SH),
or passed to a child with the descriptor (a sweep hands each run its device leases), and filelock
opens and owns its own lock file, exclusive only. flock belongs to the open file, so the kernel
drops it when the last descriptor of that open file closes: a holder killed with -9 leaves no
stale lock behind.
"""
from __future__ import annotations

import fcntl
import time


def lock(fd: int, *, shared: bool = False, wait: float | None = 0.0,
         poll: float = 0.01) -> bool | None:
    """flock `fd`, exclusive or `shared`: True once held; False when another open file still
    held it after `wait` seconds (0: one try; None: block until it is free); None where flock is
    not supported (ENOLCK, EOPNOTSUPP: some network filesystems). While it waits, it tries again
    every `poll` seconds."""
    op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    if wait is None:
        try:
            fcntl.flock(fd, op)
            return True
        except OSError:
            return None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        except OSError:
            return None
