"""DataLoader worker processes that leave stop signals to their rank's main process, from birth.

torchrun's agent stops a rank by sending SIGTERM to the rank's whole process group, a sweep stops
a run the same way, and a terminal's Ctrl-C goes to its foreground group: loader workers included.
A loader worker killed by it makes the rank fail in the middle of the step it should finish before
saving a checkpoint ("DataLoader worker exited unexpectedly"). A worker that moved to a group of its
own only once its `worker_init_fn` ran was still exposed while it started up: each epoch's start
with workers that are not persistent, and a run's first batches.

So the workers come from a multiprocessing context whose processes are started with the stop
signals blocked (a blocked signal stays blocked through fork and exec; a fork server's children
block them first thing) and, first thing in the new process, move to a process group of their
own, ignore SIGINT and SIGUSR1 and unblock them. SIGTERM stays blocked, taken by a thread of the
worker that looks at who sent it: from the rank (torch's terminate() of a worker that does not
stop, also one sent while the worker started) it ends the worker as SIGTERM's default does; from
anyone else it is dropped (the old group's too), unless the worker lost its parent: an orphan
ends on anyone's. `pkill -f`, SLURM's scancel and time limit, and systemd's stop send SIGTERM to
every process of a job one by one: a worker that died of it failed its rank, which was stopping
to save a checkpoint ("DataLoader worker ... is killed by signal: Terminated"). The rank,
signalled too, ends its workers itself when it stops, and they notice if it dies. A process the
worker forks from Python gets SIGTERM back; a program it runs through subprocess starts with
SIGTERM blocked (subprocess keeps the signal mask): Popen.kill() ends it, terminate() does not.
Without sigwaitinfo (macOS) SIGTERM keeps its default there, the old group's dropped at the start.
Not covered: a fork server's child (forkserver, Python 3.14's default on Linux) holds threads
started before it could block SIGTERM, and torch's worker handler, which they run, ends the
worker on anyone's SIGTERM: there a job-wide SIGTERM still ends the workers, as before.
A context of the user's own class (not fork, spawn or forkserver) is kept as it is, and its
workers share the rank's group. With forkserver, Python's fork server is started before the block (so that what the
user starts from it later is not born with blocked signals) and stays in the rank's group: a stop
sent to the group ends it, and its workers with it; fork (Linux's default) and spawn have no such
process.

A context may also be given the CPUs its workers run on (`cpus`): each worker moves there first
thing, whatever the thread that started it runs on (a rank whose main thread keeps a core of its
own: core/system/cpu_placement.py).
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from multiprocessing import context as mp_context
from multiprocessing import forkserver, resource_tracker
from multiprocessing import queues as mp_queues

_IGNORED = (signal.SIGINT, signal.SIGUSR1)  # the rank's main process acts on them alone
_BLOCKED = {signal.SIGTERM, *_IGNORED}


class _OwnGroup:
    """A multiprocessing Process mixin: started with the stop signals blocked, runs in its own
    process group (and on `_cpus`, where its context gave it some)."""

    _cpus: tuple[int, ...] | None = None

    def start(self) -> None:
        if self._start_method != "fork":  # the tracker's start unblocks SIGTERM: start it first
            resource_tracker.ensure_running()
        if self._start_method == "forkserver":  # a server born blocked would pass that on for life
            forkserver.ensure_running()
        self._starter = os.getpid()
        queues = [a for a in self._args if isinstance(a, mp_queues.Queue)]  # start() drops _args
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        _hold_queues(self, queues)

    def join(self, timeout=None) -> None:
        super().join(timeout)
        if _ended(self):
            _HELD.pop(self, None)

    def run(self) -> None:
        # a fork server's child was forked from the server, not from our start(): block them now
        signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        if self._cpus:  # born on its starter's CPUs (a rank's main thread may keep a core alone)
            with contextlib.suppress(OSError):  # CPUs taken away since the plan: stay where born
                os.sched_setaffinity(0, self._cpus)
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_IGN)  # also discards one already pending
        if hasattr(signal, "sigwaitinfo"):  # one pending since the start is the thread's to judge
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a handler forked from the rank
            _take_sigterm(self._starter)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED)
        else:  # (macOS) SIGTERM keeps its default: the old group's dropped, the rank's kept
            told = _sigterm_pending_from(self._starter)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # discard the old group's, then the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _BLOCKED)
            if told:  # the rank ended this worker while it started: end as torch expects
                os.kill(os.getpid(), signal.SIGTERM)
        super().run()


def _hold_queues(process, queues: list) -> None:
    """Keep the queues a worker is started with reachable until it has ended. A loader iterator
    dropped in a reference cycle (a stopped script's traceback holds one) is collected with its
    queues, and the collector runs the queues' finalizers (which end their feeder threads) before
    the iterator's __del__, whose "stop" to each worker is then never sent: torch waits 5 s for
    each worker before it kills it. Workers in the rank's group had died of the stop signal by
    then; ours ignore it, so the wait was theirs."""
    for held in [p for p in _HELD if _ended(p)]:  # ended without a join (killed by torch)
        _HELD.pop(held, None)
    if queues:
        _HELD[process] = queues


_HELD: dict = {}  # a started worker's Process -> the queues it was given


def _ended(process) -> bool:
    try:
        return process.exitcode is not None
    except ValueError:  # closed: it had ended
        return True


def _take_sigterm(starter: int) -> None:
    """A thread that takes every SIGTERM (blocked in the worker's other threads): the one `starter`
    sends ends the worker as SIGTERM's default does, anyone else's is dropped, unless the worker
    has lost its parent (an orphan ends on anyone's)."""
    parent = os.getppid()

    def take() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != starter and os.getppid() == parent:
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # this thread alone takes it:
        os.kill(os.getpid(), signal.SIGTERM)  # the default's end, as torch's terminate() expects

    threading.Thread(target=take, name="multigpu-sigterm", daemon=True).start()
    # a Python fork of the worker has no such thread: SIGTERM's default there
    os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}))


def _sigterm_pending_from(pid: int) -> bool:
    """Whether a SIGTERM is pending here (blocked) that `pid` sent; takes it off the pending set.
    One sent to the process group by anyone else does not count."""
    if not hasattr(signal, "sigtimedwait"):  # (macOS) every pending one is dropped
        return False
    info = signal.sigtimedwait({signal.SIGTERM}, 0)
    return info is not None and info.si_pid == pid


class _ForkProcess(_OwnGroup, mp_context.ForkProcess):
    pass


class _SpawnProcess(_OwnGroup, mp_context.SpawnProcess):
    pass


class _ForkServerProcess(_OwnGroup, mp_context.ForkServerProcess):
    pass


class _Placed:
    """A context mixin: its processes are ours (`_process`), run on `cpus` (None: on their
    starter's). The CPUs go with each process object, which spawn and forkserver pickle."""
    _process: type

    def __init__(self, cpus=None):
        super().__init__()
        self.cpus = tuple(sorted(cpus)) if cpus else None

    def Process(self, *args, **kwargs):  # noqa: N802 - multiprocessing's name
        process = self._process(*args, **kwargs)
        process._cpus = self.cpus
        return process


class _ForkContext(_Placed, mp_context.ForkContext):
    _process = _ForkProcess


class _SpawnContext(_Placed, mp_context.SpawnContext):
    _process = _SpawnProcess


class _ForkServerContext(_Placed, mp_context.ForkServerContext):
    _process = _ForkServerProcess


_OURS = {"fork": _ForkContext, "spawn": _SpawnContext, "forkserver": _ForkServerContext}


def own_group_context(context, cpus=None):
    """The DataLoader `multiprocessing_context` to use in place of the user's (None, a method's
    name or a context object): the same start method, with workers in their own process group,
    on `cpus` where given (a context of the user's own class is kept as it is, `cpus` unused)."""
    if os.name != "posix":
        return context
    if context is None:  # torch's default: multiprocessing's, left unset if nobody set it
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    elif isinstance(context, str):
        method = context
    elif type(context) in (mp_context.ForkContext, mp_context.SpawnContext, mp_context.ForkServerContext):
        method = context.get_start_method()
    else:
        return context
    return _OURS[method](cpus) if method in _OURS else context
