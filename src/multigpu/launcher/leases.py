"""Device leases: two multigpu processes never take the same GPU, even in the seconds before
either has a CUDA context that NVML could see.

A lease is an exclusive flock on `<lease dir>/<key>.lock`, one file per GPU (keyed by its UUID)
or CPU core. flock belongs to the open file, so:
- a process killed with -9 loses its leases at once (no stale lock to clean up);
- a child that inherits the descriptors (a sweep hands them to each run with pass_fds) keeps the
  lease while it lives, even after the parent is gone.
The holder writes "<pid> <what>" into the file so that others can say who has the device.
Lock files are never deleted: a process may have one open, and after a delete the next one would
lock a new file of the same name, so two processes would hold the same key.

`multigpu train` and `multigpu run` lease the GPUs they chose; `devices.busy_reason` treats a
GPU leased by someone else as busy. Keys in $MULTIGPU_LEASES were leased for this process by its
parent (a sweep) and count as ours. Leasing is best effort: where the folder cannot be written
or does not support flock, nothing is leased and nothing is said.
"""
from __future__ import annotations

import os
from pathlib import Path

from multigpu.core.system import locks

LEASE_DIR_ENV = "MULTIGPU_LEASE_DIR"
HELD_ENV = "MULTIGPU_LEASES"
_KEPT: list[Lease] = []  # leases held until this process exits (keep())


def lease_dir() -> Path:
    """One folder for the whole machine: /tmp, not $TMPDIR, which differs between sessions
    (SLURM jobs, IDEs) that share the GPUs."""
    return Path(os.environ.get(LEASE_DIR_ENV) or "/tmp/multigpu-leases")


def gpu_key(info) -> str:
    return f"gpu-{info.uuid}" if getattr(info, "uuid", "") else f"gpu-{info.index}"


def cpu_key(core: int) -> str:
    return f"cpu-{core}"


def inherited() -> set[str]:
    """Keys a parent process leased for us ($MULTIGPU_LEASES)."""
    return {k for k in os.environ.get(HELD_ENV, "").split(",") if k}


class Lease:
    """Locks on some keys, held while the descriptors are open (here or in a child)."""

    def __init__(self, keys: tuple[str, ...] = (), fds: list[int] | None = None):
        self.keys, self._fds = tuple(keys), list(fds or [])

    def fds(self) -> list[int]:
        return list(self._fds)

    def release(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _open(key: str) -> int | None:
    """The lock file of `key`, opened (made where missing); None when the folder is unusable."""
    folder = lease_dir()
    try:
        if not folder.is_dir():
            try:
                folder.mkdir(parents=True)
                os.chmod(folder, 0o1777)  # shared by every user of the machine, like /tmp
            except FileExistsError:  # made by someone else just now
                pass
        try:  # without O_CREAT first: in a sticky folder (fs.protected_regular) opening another
            fd = os.open(folder / f"{key}.lock", os.O_RDWR)  # user's file with it is refused
        except FileNotFoundError:
            fd = os.open(folder / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None
    try:
        os.fchmod(fd, 0o666)  # past the umask, so that other users can lease it too
    except OSError:
        pass  # another user's file: we could open it for writing, that is enough
    return fd


def try_lease(keys, note: str) -> Lease | None:
    """Lease every key or none, without waiting: None when one is held by another process."""
    ours = inherited()
    keys = tuple(dict.fromkeys(keys))
    taken: list[int] = []
    for key in (k for k in keys if k not in ours):
        fd = _open(key)
        # tries over ~30 ms: holder() takes a shared lock for an instant to look, and
        # that instant must not make a lease fail
        got = None if fd is None else locks.lock(fd, wait=0.03)
        if not got:
            for f in taken + ([fd] if fd is not None else []):
                os.close(f)
            return None if got is False else Lease(keys)  # unusable folder: lease nothing
        taken.append(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {note}\n".encode(), 0)
        except OSError:  # a full disk: the lease holds, only the note is missing
            pass
    return Lease(keys, taken)


def holder(key: str) -> str | None:
    """Who holds `key` ("pid 12 (multigpu sweep sweeps/ts)"), or None when it is free or ours."""
    if key in inherited():
        return None
    try:
        fd = os.open(lease_dir() / f"{key}.lock", os.O_RDONLY)
    except OSError:  # never leased here (or no folder): free
        return None
    try:
        if locks.lock(fd, shared=True) is not False:
            return None  # free (the shared lock goes with the close below)
        text = os.pread(fd, 300, 0).decode(errors="replace").strip()
    finally:
        os.close(fd)
    pid, _, what = text.partition(" ")
    if pid == str(os.getpid()):  # leased by this process (maybe for a child it started)
        return None
    return f"pid {pid} ({what})" if what else f"pid {pid or '?'}"


def keep(lease: Lease) -> Lease:
    """Hold `lease` until this process exits."""
    _KEPT.append(lease)
    return lease
