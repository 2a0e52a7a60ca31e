"""core.locks.lock between two processes: the second is refused at once, waits until the holder
lets go, shares a shared lock, and finds the lock free once the holder is killed with -9."""
import os
import subprocess
import sys
import time

import pytest

from multigpu.core.system import locks

HOLDER = """
import os, sys, time
from multigpu.core.system import locks
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
print(locks.lock(fd, shared=sys.argv[2] == "shared"), flush=True)
if len(sys.argv) > 3:
    time.sleep(float(sys.argv[3]))  # held for that long, then the process ends
else:
    sys.stdin.readline()  # held until the test writes a line (or kills this process)
"""


@pytest.fixture
def hold(tmp_path):
    """Start a process that takes the lock on tmp_path/x.lock; returns (it, the path)."""
    started = []
    path = tmp_path / "x.lock"

    def start(kind: str = "exclusive", *seconds: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), kind, *seconds],
                             stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=os.environ.copy())
        started.append(p)
        assert p.stdout.readline().strip() == "True"
        return p
    yield start, path
    for p in started:
        p.kill()
        p.wait(10)


def _fd(path) -> int:
    return os.open(path, os.O_RDWR)


def test_a_held_lock_refuses_at_once_and_again_after_the_wait(hold):
    start, path = hold
    start()
    fd = _fd(path)
    try:
        began = time.monotonic()
        assert locks.lock(fd) is False
        assert locks.lock(fd, shared=True) is False
        assert locks.lock(fd, wait=0.3, poll=0.05) is False
        assert time.monotonic() - began >= 0.3
    finally:
        os.close(fd)


def test_a_waiter_gets_the_lock_when_the_holder_lets_go(hold):
    start, path = hold
    holder = start()
    fd = _fd(path)
    try:
        holder.stdin.write("\n")  # let go in a moment: the process ends
        holder.stdin.flush()
        assert locks.lock(fd, wait=30) is True
    finally:
        os.close(fd)
    holder.wait(10)


def test_blocking_waits_for_the_holder(hold):
    start, path = hold
    began = time.monotonic()
    holder = start("exclusive", "1.0")  # lets go 1 s after it took the lock
    fd = _fd(path)
    try:
        assert locks.lock(fd, wait=None) is True
        assert holder.wait(10) == 0
        assert time.monotonic() - began >= 1.0
    finally:
        os.close(fd)


def test_shared_holders_share_and_keep_an_exclusive_one_out(hold):
    start, path = hold
    start("shared")
    fd = _fd(path)
    try:
        assert locks.lock(fd, shared=True) is True
    finally:
        os.close(fd)
    fd = _fd(path)
    try:
        assert locks.lock(fd) is False
    finally:
        os.close(fd)


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(hold):
    start, path = hold
    holder = start()
    holder.kill()
    holder.wait(10)
    fd = _fd(path)
    try:
        assert locks.lock(fd) is True
    finally:
        os.close(fd)
