"""The ranks of this machine, started and watched by the launcher itself (launch.launch), with
torch's public API only, on one machine or several.

One attempt: where the ranks meet (one machine: a fresh store on loopback, local_rendezvous, its
port bound first; several: torch's c10d rendezvous of the nodes, node_rendezvous), the N ranks
started with subprocess.Popen, each in a session of its own, with the environment torch's agent
gives a worker, then the store served (the launcher imports torch there, while the ranks import
theirs); their logs laid out as torch's DefaultLogsSpecs lays them out (rank_logs: <log dir>/<run
id>_*/attempt_<n>/<local rank>/{stdout,stderr}.log and error.json, TORCHELASTIC_ERROR_FILE),
--tee through torch's TailLog with `[rankN]:` prefixes. Not torch's start_processes: its
PContext.wait() stops every rank the moment one fails, so nothing could be said to the ranks
first (stop_reason) nor the others let end by themselves (RANKS_STOP_WAIT).

The rules (torch's elastic agent's, with multigpu's additions):
  - all ranks exit 0: done. A rank fails: which ranks ended and how is written for the others
    (stop_reason), unless each stopped on a stop signal (then, in multigpu train, the others get
    RANKS_STOP_WAIT s to end too); the rest get SIGTERM, 30 s, then SIGKILL; what is left of
    each failed rank's session is killed (sessions.end_session_left).
  - --max-restarts: a warning line, then the next attempt (not after ranks that stopped
    together on a signal, in multigpu train).
  - a stop signal to the launcher is passed on to every rank's process group; they get
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30) s, then SIGKILL; a second signal kills them at once
    (while the nodes meet: the launch ends there).
  - several nodes: a node waiting in the rendezvous (it restarts after a failure, or joins)
    ends this node's ranks too (SIGTERM, said to them as why) and the nodes meet again, with
    no restart counted here; the rendezvous closed by another node (it ended the run) ends them
    as a failure. Ranks all done: every node waits for the others' (exit barrier) before the
    rendezvous is shut down.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from multigpu.core import startup_sigint
from multigpu.launcher import local_rendezvous, sessions
from multigpu.launcher.health import lost_devices
from multigpu.launcher.health.lost_devices import LostDevices, NextAttempt, Restart
from multigpu.launcher.rank import stop_reason
from multigpu.launcher.launch_failures import err, restart_line
from multigpu.launcher.local_rendezvous import Attempt, rank_command, rank_environment
from multigpu.launcher.node_rendezvous import CLOSED, LOST, REJOIN, WHY

MONITOR_INTERVAL = 0.1  # s between two looks at the ranks (torchrun's --monitor-interval)
STOP_SIGNALS = [getattr(signal, s) for s in stop_reason.STOP_SIGNALS.split(",")]
DONE, FAILED, STOPPED = "done", "failed", "stopped"  # how an attempt ended (_watch)


@dataclass
class LoopSpec:
    """What the loop runs: `cmd` on `nproc` ranks (python: with this Python, torchrun's way)."""
    cmd: list[str]
    nproc: int
    run_id: str
    logs: Any  # rank_logs.RankLogs (or torch's DefaultLogsSpecs): one per launch, its run folder
    #           made at the first attempt
    max_restarts: int = 0
    python: bool = False
    tee: bool = False
    ranks_stop_together: bool = False  # multigpu train: its ranks stop together, and say it
    our_worker: bool = False  # multigpu run's worker (rank/worker.py): it guards its start-up too
    ranks_store: Callable[[], tuple[Any, int]] = local_rendezvous.ranks_store  # one machine
    nodes: Any = None  # several: node_rendezvous.NodeRendezvous, where the nodes meet each attempt
    devices: tuple = ()  # device_health.Device of each local rank (--min-devices)
    lost: LostDevices | None = None  # --min-devices: a lost device dropped (lost_devices)


@dataclass
class LoopResult:
    failures: dict = field(default_factory=dict)  # rank -> ProcessFailure, in the order seen
    exit_codes: dict = field(default_factory=dict)  # local rank -> exit code, at the end
    stop: StopSignals | None = None
    restarts: list = field(default_factory=list)  # lost_devices.Restart of each restart
    ended_elsewhere: str | None = None  # several nodes: why another node ended the run (WHY)


class Stopped(BaseException):  # not an Exception: torch's rendezvous code catches those
    """A stop signal while the nodes meet (no rank runs): the launch ends there."""


class StopSignals:
    """The launcher's handlers of the stop signals while the ranks run: the first is passed on to
    every rank's process group, a second kills them at once. Only in the main thread (elsewhere
    Python has no handlers: the ranks then stop with the launcher's own end)."""

    def __init__(self):
        self.signals, self.sig, self.first_at = 0, None, None
        self.ranks: Ranks | None = None
        self.meeting = False  # the nodes meeting (torch's rendezvous): a signal ends the launch

    def waited_out(self, wait: float) -> bool:
        """Whether the wait after the first signal (`wait` s) ran out: the ranks that had not
        stopped were killed, maybe in the middle of a checkpoint."""
        return self.first_at is not None and time.monotonic() - self.first_at >= 0.97 * wait

    def _handler(self, signum, frame) -> None:
        self.signals += 1
        self.sig = signal.Signals(signum)
        self.first_at = self.first_at or time.monotonic()
        if self.ranks is not None:
            self.ranks.kill() if self.signals > 1 else self.ranks.send(self.sig, forwarded=True)
        if self.meeting:
            raise Stopped(self.sig.name)

    def __enter__(self):
        self._saved = {}
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._saved[s] = signal.signal(s, self._handler)
        if startup_sigint.take_heard():  # a Ctrl-C whose KeyboardInterrupt was dropped: no rank starts
            self._handler(signal.SIGINT, None)
        return self

    def __exit__(self, *exc):
        for s, handler in self._saved.items():
            signal.signal(s, handler)


class Ranks:
    """The processes of one attempt, by local rank."""

    def __init__(self, spec: LoopSpec, attempt: Attempt, stop: StopSignals):
        self.attempt = attempt
        envs = {r: rank_environment(r, attempt) for r in range(spec.nproc)}
        dest = spec.logs.reify(envs)  # the attempt's folders; TORCHELASTIC_ERROR_FILE in envs
        self.error_files: dict[int, str] = dest.error_files
        self.procs: dict[int, subprocess.Popen] = {}
        self.failures: dict = {}
        self.failed_at: float | None = None  # time.time() the first failure was seen
        self.signalled: set[int] = set()
        # multigpu train's ranks and run's workers are born with SIGINT blocked (a mask stays
        # through fork and exec): one passed on before a rank can take it (Python's start-up,
        # `site`, the package's first imports) waits until its first line unblocks it
        # (startup_sigint.guard), instead of a traceback from there. Not a command of the user's
        # own (run --no-python): nothing of it would unblock the signal.
        blocked = {signal.SIGINT} if spec.ranks_stop_together or spec.our_worker else set()
        for r in range(spec.nproc):
            if stop.signals:  # asked to stop while starting: the others are not started
                break
            old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            try:
                self.procs[r] = _popen(rank_command(spec.cmd, r, spec.python), envs[r],
                                       dest.stdouts[r], dest.stderrs[r])
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        self.tails = _tails(dest, spec.nproc, attempt.first_rank) if spec.tee else []

    def poll(self) -> None:
        """The ranks that ended with a code other than 0 since the last look, as failures (by
        global rank)."""
        for r, p in self.procs.items():
            if self.attempt.first_rank + r not in self.failures and p.poll() not in (None, 0):
                # torch only now: a stop before the store served (_serve) imports none
                from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

                self.failures[self.attempt.first_rank + r] = ProcessFailure(
                    local_rank=r, pid=p.pid, exitcode=p.returncode, error_file=self.error_files[r])
                self.failed_at = self.failed_at or time.time()

    def codes(self) -> dict[int, int | None]:
        return {r: p.poll() for r, p in self.procs.items()}

    def running(self) -> list[int]:
        return [r for r, code in self.codes().items() if code is None]

    def send(self, sig: signal.Signals, forwarded: bool = False) -> None:
        """`sig` to the process group of each running rank not given one yet; `forwarded`: a stop
        signal the launcher got, said first in the attempt's folder (stop_reason.mark_forwarded)."""
        if forwarded and any(r not in self.signalled for r in self.running()):
            stop_reason.mark_forwarded(self.error_files, sig)
        for r in self.running():
            if r not in self.signalled:
                self.signalled.add(r)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.procs[r].pid, sig)

    def kill(self) -> None:
        """SIGKILL to every rank's process group and to what they started."""
        for r in self.running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.procs[r].pid, signal.SIGKILL)
        sessions.kill_workers_left()

    def wait(self, until: float) -> None:
        """Until every rank has ended or time.monotonic() is `until`."""
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(until - time.monotonic(), 0))

    def close(self, sig: signal.Signals, until: float, forwarded: bool = False) -> None:
        """`sig` to the ranks still running (`forwarded`: as send's), SIGKILL to those left at
        `until`; then the failures it made counted, the --tee tails ended, and the sessions of
        failed ranks killed."""
        self.send(sig, forwarded)
        self.wait(until)
        if self.running():
            self.kill()
            self.wait(time.monotonic() + sessions.AGENT_STOP_WAIT)  # bounded: a D-state rank
        self.poll()
        for tail in self.tails:
            tail.stop()
        for p in self.procs.values():
            if p.poll() not in (None, 0):
                sessions.end_session_left(p.pid)


def _popen(cmd: list[str], env: dict[str, str], stdout: str, stderr: str) -> subprocess.Popen:
    """One rank in a session of its own, its output to its log files ("": this console)."""
    with contextlib.ExitStack() as files:
        out, errs = (files.enter_context(open(path, "w")) if path else None  # noqa: SIM115
                     for path in (stdout, stderr))
        return subprocess.Popen(cmd, env={**os.environ, **env}, stdout=out, stderr=errs,
                                start_new_session=True)


def _tails(dest, nproc: int, first_rank: int) -> list:
    """--tee: every rank's stdout and stderr logs shown on this console, `[rankN]:` first (N the
    global rank, as torchrun's)."""
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog

    prefixes = {r: f"[rank{first_rank + r}]:" for r in range(nproc)}
    return [TailLog("default", dest.tee_stdouts, sys.stdout, prefixes).start(),
            TailLog("default", dest.tee_stderrs, sys.stderr, prefixes).start()]


def run(spec: LoopSpec) -> LoopResult:
    """Every attempt of the launch, until one ends: all ranks done, a failure with no restart
    left (or, with --min-devices, too few healthy devices), a stop signal, or (several nodes)
    another node's end of the run. The result says which (launch.launch reports it)."""
    restarts: list[Restart] = []
    number = 0
    with StopSignals() as stop:
        while True:
            try:
                ranks, how = _attempt(spec, number, stop)
            except Stopped:  # while the nodes met: no rank of this attempt was started
                return LoopResult(stop=stop, restarts=restarts)
            number = ranks.attempt.number  # several nodes: the highest count among them
            result = LoopResult(dict(ranks.failures), ranks.codes(), stop, restarts)
            if how == REJOIN and not stop.signals:
                err(f"warning: {WHY[REJOIN]}")
                continue  # not a restart of this node's: the count stays
            if how in (CLOSED, LOST):
                result.ended_elsewhere = WHY[how]
                return result
            if stop.signals or not ranks.failures or number == spec.max_restarts:
                return result
            if spec.ranks_stop_together and \
                    stop_reason.all_stopped_by_signal(f.exitcode for f in ranks.failures.values()):
                return result  # a stop asked for, by a signal to a rank: no restart
            spec, said = _next_spec(spec, ranks)
            if spec is None:
                err(f"error: {said}")
                return result
            number += 1
            restarts.append(Restart(number, ranks.failed_at, tuple(
                d.name for d in said.dropped), spec.nproc))
            err(f"warning: {restart_line(ranks.failures, number, spec.max_restarts, said.on)}"
                + said.extra)


def _attempt(spec: LoopSpec, number: int, stop: StopSignals) -> tuple[Ranks, str]:
    """One attempt: where its ranks meet, the ranks started, watched and closed; (the ranks, how
    the attempt ended: _watch's answer). The ranks' store is held until they have ended (several
    nodes: until every node's have, the exit barrier)."""
    store, attempt = _meet(spec, number, stop)
    try:
        ranks = Ranks(spec, attempt, stop)
        stop.ranks = ranks
        _serve(store, ranks, stop)
        how = _watch(ranks, spec, stop)
        if how == DONE and spec.nodes is not None:
            spec.nodes.exit_barrier(lambda: stop.signals > 0)
    finally:
        getattr(store, "close", lambda: None)()
    return ranks, how


def _meet(spec: LoopSpec, number: int, stop: StopSignals) -> tuple[Any, Attempt]:
    """(the attempt's store, held here, or None; the attempt its ranks are told of). One machine:
    a fresh loopback store (spec.ranks_store); several: the nodes' rendezvous, which a stop
    signal ends (Stopped)."""
    attempt = Attempt(spec.run_id, spec.nproc, number, spec.max_restarts, 0, _visible(spec.devices))
    if spec.nodes is None:
        store, port = spec.ranks_store()
        return store, replace(attempt, master_port=port)
    stop.meeting = True
    try:
        if stop.signals:
            raise Stopped(stop.sig.name)
        return spec.nodes.next_attempt(attempt)
    finally:
        stop.meeting = False


def _serve(store, ranks: Ranks, stop: StopSignals) -> None:
    """The attempt's store served (local_rendezvous.LoopbackStore: torch imported here, while the
    ranks import theirs), after a stop signal too: a rank already waiting in the socket's backlog
    is inside torch's C++ and hears its SIGINT only once the store answers (unserved, it would
    wait until the stop's kill, RANKS_STOP_WAIT later). Where serving fails, the ranks are killed
    (the error is the launcher's: launch.py says it)."""
    if not hasattr(store, "serve"):
        return
    try:
        store.serve()
    except BaseException:
        ranks.kill()
        ranks.wait(time.monotonic() + sessions.AGENT_STOP_WAIT)
        raise


def _next_spec(spec: LoopSpec, ranks: Ranks) -> tuple[LoopSpec | None, Any]:
    """The spec of the attempt after a failure, and what the restart line says of it (a
    NextAttempt); without one, (None, the line that says why)."""
    if spec.lost is None:
        return spec, NextAttempt(spec.devices, None, "")
    found = lost_devices.next_attempt(spec.lost, spec.devices, ranks.failures)
    if isinstance(found, lost_devices.Stop):
        return None, found.line
    if found.devices == tuple(spec.devices):
        return spec, found
    return replace(spec, devices=found.devices, nproc=len(found.devices),
                   cmd=found.cmd or spec.cmd), found


def _visible(devices) -> str | None:
    """The ranks' CUDA_VISIBLE_DEVICES for an attempt on these devices (None: as launched)."""
    tokens = [d.token for d in devices]
    return ",".join(tokens) if tokens and all(tokens) else None


def _watch(ranks: Ranks, spec: LoopSpec, stop: StopSignals) -> str:
    """Look at the ranks until they have all ended, one failed, the launcher got a stop signal
    or (several nodes) the nodes' rendezvous asks for the attempt's end; the attempt closed
    accordingly. Returns how: DONE, FAILED, STOPPED or node_rendezvous.why_end()'s answer."""
    while True:
        if stop.signals:  # passed on by the handler; the ranks get the shutdown timeout
            at_once = stop.signals > 1  # two before the ranks were all started: no wait
            ranks.close(stop.sig, time.monotonic() if at_once else stop.first_at + sessions.stop_wait(),
                        forwarded=True)
            return STOPPED
        ranks.poll()
        if ranks.failures:
            _close_failed(ranks, spec, stop)
            return FAILED
        if not ranks.running():
            ranks.close(signal.SIGTERM, time.monotonic())
            return DONE
        if spec.nodes is not None and (why := spec.nodes.why_end()):
            stop_reason.write_line(ranks.error_files, WHY[why])
            ranks.close(signal.SIGTERM, time.monotonic() + sessions.AGENT_STOP_WAIT)
            return why
        time.sleep(MONITOR_INTERVAL)


def _close_failed(ranks: Ranks, spec: LoopSpec, stop: StopSignals) -> None:
    """An attempt a rank failed: before the others get SIGTERM, which local ranks ended and how,
    for them to read (stop_reason), unless each ended on a stop signal (then, where the ranks
    stop together, the others get RANKS_STOP_WAIT s to end by themselves first)."""
    ended = {r: code for r, code in ranks.codes().items() if code not in (None, 0)}
    if stop_reason.all_stopped_by_signal(ended.values()):
        if spec.ranks_stop_together and not stop.signals:
            sessions.let_the_others_end(ranks.procs.values(), sessions.RANKS_STOP_WAIT)
        ended = {}  # a stop on a signal, not a failure to say
    if ended and not stop.signals:
        stop_reason.write(ranks.error_files, ended)
    ranks.close(signal.SIGTERM, time.monotonic() + sessions.AGENT_STOP_WAIT)
