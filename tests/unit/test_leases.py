"""Device leases, held and lost by real processes: a second holder is refused and named, kill -9
frees the key at once, all or nothing, inherited keys are ours, and descriptors handed to a child
keep the lease while the child lives."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from multigpu.launcher import leases


@pytest.fixture(autouse=True)
def lease_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(tmp_path / "leases"))
    monkeypatch.delenv(leases.HELD_ENV, raising=False)
    return tmp_path / "leases"


@contextlib.contextmanager
def held_elsewhere(*keys, note="multigpu sweep sweeps/ts"):
    """A separate process that leases `keys` (in this $MULTIGPU_LEASE_DIR) and sleeps until killed."""
    code = textwrap.dedent(f"""
        import time
        from multigpu.launcher import leases
        assert leases.try_lease({list(keys)!r}, {note!r}).fds()
        print("ready", flush=True)
        time.sleep(120)
        """)
    env = {k: v for k, v in os.environ.items() if k != leases.HELD_ENV}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        yield p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def test_a_held_key_is_refused_and_named_then_freed_by_kill_9():
    with held_elsewhere("gpu-A") as proc:
        assert leases.try_lease(["gpu-A"], "me") is None
        assert leases.holder("gpu-A") == f"pid {proc.pid} (multigpu sweep sweeps/ts)"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert leases.holder("gpu-A") is None  # no stale lease: the kernel dropped the lock
        with leases.try_lease(["gpu-A"], "me") as got:
            assert len(got.fds()) == 1
            assert (leases.lease_dir() / "gpu-A.lock").read_text() == f"{os.getpid()} me\n"


def test_all_or_nothing():
    with held_elsewhere("gpu-B"):
        assert leases.try_lease(["gpu-A", "gpu-B"], "me") is None
        with leases.try_lease(["gpu-A"], "me") as got:  # gpu-A was not left taken
            assert len(got.fds()) == 1


def test_release_frees():
    got = leases.try_lease(["cpu-0", "cpu-1"], "me")
    assert leases.try_lease(["cpu-1"], "again") is None  # another open file is refused, even here
    got.release()
    got.release()  # idempotent
    assert got.fds() == []
    assert leases.try_lease(["cpu-1"], "again") is not None


def test_keys_a_parent_leased_for_us_are_ours(monkeypatch):
    with held_elsewhere("gpu-C"):
        monkeypatch.setenv(leases.HELD_ENV, "gpu-C,cpu-3")  # as a sweep starts its runs
        assert leases.holder("gpu-C") is None
        got = leases.try_lease(["gpu-C", "gpu-D"], "me")
        assert got.keys == ("gpu-C", "gpu-D") and len(got.fds()) == 1  # only gpu-D locked here


def test_descriptors_handed_to_a_child_keep_the_lease():
    got = leases.try_lease(["gpu-E"], "multigpu sweep x")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             pass_fds=got.fds())
    try:
        got.release()  # the sweep lets go; the run it started still holds the GPU
        assert leases.try_lease(["gpu-E"], "me") is None
        child.kill()
        child.wait()
        assert leases.try_lease(["gpu-E"], "me") is not None
    finally:
        child.kill()
        child.wait()


def test_an_unusable_folder_leases_nothing_silently(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(tmp_path / "file" / "leases"))
    got = leases.try_lease(["gpu-A"], "me")
    assert got is not None and got.fds() == []
    assert leases.holder("gpu-A") is None
    assert capsys.readouterr() == ("", "")


def test_the_folder_is_shared_by_every_user(lease_dir):
    old = os.umask(0o022)
    try:
        leases.try_lease(["gpu-F"], "me").release()
    finally:
        os.umask(old)
    assert lease_dir.stat().st_mode & 0o7777 == 0o1777
    assert (lease_dir / "gpu-F.lock").stat().st_mode & 0o777 == 0o666


def test_keys():
    from multigpu.launcher.devices import GpuInfo

    assert leases.gpu_key(GpuInfo(3, "H200", 0, 1, uuid="GPU-9f")) == "gpu-GPU-9f"
    assert leases.gpu_key(GpuInfo(3, "H200", 0, 1)) == "gpu-3"
    assert leases.cpu_key(5) == "cpu-5"
