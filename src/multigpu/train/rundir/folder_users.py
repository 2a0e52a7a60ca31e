"""Who uses a run folder: a shared flock on the folder itself, held by every process of a launch.

The launcher takes it when it claims the folder (runfolder.reserve); each worker of `multigpu
train` takes it from its first line (hold_from_env). A lock belongs to its open file, so the
kernel drops it when its holder dies, kill -9 included: a folder that nobody holds is used by no
live process, and a run folder in which nothing was trained (a launch killed during start-up) can
be taken again. While the workers of a dead launcher are still stopping they hold it, and the
same command waits for them (they end within orphans.GRACE_SECONDS) instead of refusing.

Claims of a folder are serialised by an exclusive flock on its parent folder, held for the
instant of the decision, so that two commands never both take the same folder.
Best effort: where flock is unsupported, a folder in which nothing was trained is not taken
again, and a run is continued (--resume) as before, unchecked.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from multigpu.core.system import locks

OUT_RESERVED_ENV = "MULTIGPU_OUT_RESERVED"  # set by the CLI for the workers it launches
_HELD: dict[str, int] = {}  # folder -> descriptor, held until this process exits or release()


def hold(path: Path) -> bool:
    """Hold `path` as one of its users until this process exits; whether that worked."""
    release(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    if locks.lock(fd, shared=True, wait=1.0):  # a claimer looks (LOCK_EX) for an instant
        _HELD[_key(path)] = fd
        return True
    os.close(fd)
    return False


def _forget_in_child() -> None:
    """In a process forked from a holder (a DataLoader worker): its copies of the held
    descriptors are closed (not unlocked: the lock belongs to the holder), so the lock ends with
    the holder, not with the last of its children."""
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def release(path: Path) -> None:
    """Stop holding `path` in this process. A process that claims a folder it holds already
    (a library caller continuing its own run) must not count as another user of it."""
    fd = _HELD.pop(_key(path), None)
    if fd is not None:
        os.close(fd)


def _key(path: Path) -> str:
    return str(Path(path).resolve())


def hold_from_env() -> None:
    """In a worker of `multigpu train`: hold the run folder its launcher claimed."""
    out = os.environ.get(OUT_RESERVED_ENV)
    if out and not _HELD:
        hold(Path(out))


def in_use(path: Path) -> bool | None:
    """Whether a live process holds `path`; None when that cannot be known (no flock there:
    some network filesystems)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        got = locks.lock(fd)  # one try; the lock, if taken, goes with the close below
    finally:
        os.close(fd)
    return None if got is None else not got


def holders(path: Path) -> list[int]:
    """The pids holding `path`, from /proc/locks (Linux); [] when unknown."""
    try:
        st = os.stat(path)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  READ  1234 08:01:5678 0 EOF" (waiters carry "->"); the inode
        # alone: overlay filesystems name another device there than stat() gives
        if len(fields) >= 6 and fields[1] == "FLOCK" and "->" not in fields and \
                fields[5].rsplit(":", 1)[-1] == str(st.st_ino):
            pids.append(int(fields[4]))
    return sorted(set(pids))


def orphaned_workers(pids: list[int]) -> bool:
    """Whether every pid is a worker whose launcher has died (it is stopping: orphans.py), or has
    ended already (a lock named for a pid that is gone ends with what still holds a copy)."""
    import psutil

    from multigpu.core.system.orphans import launcher_pid

    try:
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                launcher = launcher_pid(proc.environ())
            except psutil.NoSuchProcess:
                continue
            if launcher is None or proc.ppid() == launcher:
                return False
    except psutil.Error:  # not ours to read: not known to be stopping
        return False
    return bool(pids)


@contextlib.contextmanager
def claiming(path: Path, timeout: float = 30.0):
    """An exclusive flock on the parent of `path` while a claim of `path` is decided."""
    parent = path.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # the claim itself says what is wrong with the folder
        yield
        return
    try:
        # a claim is an instant: a holder this long is stuck, and where flock is unsupported
        # there is nothing to wait for; decide anyway
        locks.lock(fd, wait=timeout)
        yield
    finally:
        os.close(fd)
