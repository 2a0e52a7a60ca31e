"""Loader worker processes in a process group of their own from birth (core/loading/loader_workers.py):
what still reaches them, and what the contexts leave to the user's own processes."""
import gc
import multiprocessing
import signal
import subprocess
import sys
import time

import pytest
from torch.utils.data import DataLoader, Dataset

from multigpu.core.loading.loader_workers import own_group_context


def test_a_worker_the_rank_ends_while_it_starts_ends():
    """torch ends a worker that does not stop with terminate(); sent while a spawned worker still
    starts (its stop signals blocked), it must still end it, not be dropped with the group's."""
    proc = own_group_context("spawn").Process(target=time.sleep, args=(60,), daemon=True)
    proc.start()
    proc.terminate()
    proc.join(30)
    assert proc.exitcode == -signal.SIGTERM


def test_a_worker_started_by_the_context_is_in_a_group_of_its_own_and_ignores_sigint():
    ctx = own_group_context(None)
    queue = ctx.Queue()
    proc = ctx.Process(target=_report, args=(queue,))
    proc.start()
    pid, pgid, sigint = queue.get(timeout=30)
    proc.join(30)
    assert pgid == pid and sigint == signal.SIG_IGN


def _report(queue) -> None:
    import os

    queue.put((os.getpid(), os.getpgid(0), signal.getsignal(signal.SIGINT)))


FORKSERVER_AFTER = """
import multiprocessing, signal, time
from multigpu.core.loading.loader_workers import own_group_context
ours = own_group_context("forkserver").Process(target=time.sleep, args=(0,))
ours.start(); ours.join(30)
theirs = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(60,))
theirs.start(); time.sleep(1); theirs.terminate(); theirs.join(30)
print(theirs.exitcode)
"""


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="POSIX only")
def test_the_fork_server_it_starts_leaves_the_users_own_processes_their_signals():
    """The fork server is shared by the whole process: what the user starts from it after a loader
    did must get SIGTERM as usual (a server born with them blocked would pass that on)."""
    done = subprocess.run([sys.executable, "-c", FORKSERVER_AFTER], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(-signal.SIGTERM)]


class _Numbers(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("persistent", [True, False])
def test_a_loader_iterator_collected_in_a_reference_cycle_stops_its_workers_at_once(persistent):
    """A stopped script's traceback holds its loader's iterator in a cycle; collected, torch's
    stop never reached our workers (the cycle's queues were finalized first): it waited 5 s per
    worker and then killed them, so a Ctrl-C of a 2-worker run took 10 s more to end."""
    loader = DataLoader(_Numbers(), batch_size=4, num_workers=2, persistent_workers=persistent,
                        multiprocessing_context=own_group_context(None))
    it = iter(loader)
    next(it)
    workers = list(it._workers)
    it.cycle = it
    del it, loader
    start = time.monotonic()
    gc.collect()
    took = time.monotonic() - start
    assert not any(w.is_alive() for w in workers)
    assert took < 5, f"{took:.1f} s: torch gave up on a worker's stop (it waits 5 s for each)"


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="no sigwaitinfo (macOS): SIGTERM keeps its default")
@pytest.mark.parametrize("method", ["fork", "spawn"])  # forkserver: not covered (loader_workers.py)
def test_a_sigterm_its_rank_did_not_send_leaves_a_worker_serving(method):
    """`pkill -f`, SLURM's scancel and systemd's stop send SIGTERM to every process of a job, the
    workers too: one sent by another process (here `kill`) is dropped, and the worker goes on
    handing over batches (the rank's own SIGTERM still ends it: test_data's and the test above)."""
    loader = DataLoader(_Numbers(), batch_size=4, num_workers=1, persistent_workers=True,
                        multiprocessing_context=own_group_context(method))
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2, 3]
    worker = it._workers[0]
    subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
    time.sleep(0.5)
    assert worker.is_alive()
    assert [next(it).tolist()[0] for _ in range(15)] == list(range(4, 64, 4))
    assert worker.is_alive()
    del it, loader  # the rank's own stop ends it
    gc.collect()
    worker.join(30)
    assert worker.exitcode == 0


class _WhereAmI(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        import os

        return sorted(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="Linux only")
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_of_a_context_given_cpus_run_on_exactly_those(method):
    """A rank's main thread may keep a core of its own (cpu_placement.py): its workers, born on
    that core, must move to the CPUs they were given."""
    import os

    cpu = max(os.sched_getaffinity(0))
    loader = DataLoader(_WhereAmI(), batch_size=None, num_workers=1,
                        multiprocessing_context=own_group_context(method, cpus={cpu}))
    assert list(loader) == [[cpu], [cpu]]
    assert list(DataLoader(_WhereAmI(), batch_size=None, num_workers=1,
                           multiprocessing_context=own_group_context(method))) == [sorted(os.sched_getaffinity(0))] * 2
