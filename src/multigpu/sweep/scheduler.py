"""Running a sweep: as many runs at once as the free devices allow, each watched to its end.

Each run is a child process in its own session (a Ctrl-C in the terminal reaches the sweep only,
which then stops every run itself), with its output in DIR/logs/NAME.log; starter.py starts it,
forked from a warm process for a one-device `multigpu train`, else as a new program. It is told
to stop with SIGTERM to its process group: `multigpu train` then saves a checkpoint and exits,
and the next attempt resumes from it. A run that outlives the grace period after that is killed.
If the sweep itself dies, even by kill -9, the kernel sends each run SIGTERM (PR_SET_PDEATHSIG),
so no run goes on unwatched, and its device lease lasts until it has exited.

A run ends as:
    done     exit 0
    failed   another exit, or --timeout passed; retried up to --retries times
    stopped  the sweep was asked to stop (Ctrl-C, SIGTERM, SIGHUP); resumed by a re-run
"""
from __future__ import annotations

import collections
import os
import shlex
import signal
import time
from dataclasses import dataclass, field

from multigpu.train.rundir import runfolder
from multigpu.launcher import ports
from multigpu.core.errors import UsageError
from multigpu.sweep import spec as specs
from multigpu.sweep import starter
from multigpu.sweep.attempts import classify, prepare_folder
from multigpu.sweep.pool import Pool, Unit
from multigpu.sweep.state import RunState, SweepFolder, format_duration, log_tail
from multigpu.sweep.summary import (RunResult, absent_metric, metric_values, split_metric,
                                    write_summary)

POLL_SECONDS = 0.2


@dataclass
class Options:
    max_parallel: int | None = None
    timeout_s: float | None = None
    retries: int = 0
    metric: str | None = None
    grace_s: float = 60.0


@dataclass
class Active:
    run: specs.Run
    proc: object  # subprocess.Popen, or starter.WarmRun: pid and poll()
    units: list[Unit]
    deadline: float | None
    signalled_at: float | None = None
    timed_out: bool = False
    tries: int = 1  # attempts in this sweep process


@dataclass
class Sweep:
    spec: specs.SweepSpec
    runs: list[specs.Run]
    folder: SweepFolder
    pool: Pool
    options: Options
    echo: object = print
    stop_signal: int | None = None
    force: bool = False
    active: dict = field(default_factory=dict)
    warm: starter.WarmStarter | None = None  # the fork server, from the first warm run
    warm_preload: tuple[str, ...] = ()  # what that server imports (the caller's: the CLI's modules)
    _peak_seen_at: float = 0.0

    # ----------------------------------------------------------------------- the loop

    def execute(self) -> int:
        """Run every run that is not done; 0 when all are done, 1 when some failed, 128+N
        when stopped by signal N."""
        queue = collections.deque(self._todo())
        if not queue:
            self.write_summary()
            self.folder.event(f"nothing to do: all {len(self.runs)} runs are done; summary in "
                              f"{self.folder.root / 'summary.md'}", self.echo)
            return 0
        tries: dict[str, int] = collections.Counter()
        waiting_since = None
        with self._signals():
            while (queue or self.active) and self.stop_signal is None:
                started = self._start_ready(queue, tries)
                if not self.active and queue and not started:
                    waiting_since = self._note_waiting(waiting_since)
                for name, act in list(self.active.items()):
                    if self._finished(act, queue):
                        del self.active[name]
                time.sleep(POLL_SECONDS)
            if self.stop_signal is not None:
                self._stop_all()
        self.write_summary()
        if self.stop_signal is not None:
            self.folder.event(f"stopped by {signal.Signals(self.stop_signal).name}: run the same "
                              "command again to go on (stopped runs resume from their checkpoints)",
                              self.echo)
            return 128 + self.stop_signal
        failed = [s for s in self.states() if s.status == "failed"]
        done = sum(s.status == "done" for s in self.states())
        self.folder.event(f"finished: {done} done, {len(failed)} failed; summary in "
                          f"{self.folder.root / 'summary.md'}", self.echo)
        return 1 if failed else 0

    def refuse_while_stopping(self) -> None:
        """One line while a run that a dead sweep started still has a process: it got SIGTERM as
        that sweep died and is saving its checkpoint; a second copy would share its folder. Called
        by the sweep holding the folder's lock, before it says anything."""
        for run in self.runs:
            st = self.folder.read_state(run.name)
            if st is not None and st.status == "running" and self.folder.run_lives(st):
                raise UsageError(f"run {run.name} of an earlier sweep is still stopping (session "
                                 f"{st.pid}); wait for it, or end it with: pkill -KILL -s {st.pid}")

    def _todo(self) -> list[specs.Run]:
        self.refuse_while_stopping()
        todo = []
        for run in self.runs:
            st = self.folder.read_state(run.name) or RunState(run.name, run.params)
            if st.status == "done":
                continue
            if st.status == "running":  # the sweep that ran it is gone
                st.status, st.note = "stopped", "interrupted (the sweep ended while it ran)"
            elif st.status != "stopped":
                st.status = "pending"
            self.folder.write_state(st)
            todo.append(run)
        return todo

    def _start_ready(self, queue, tries) -> bool:
        self._learn_peak()
        limit = self.options.max_parallel or self.pool.capacity()
        started = False
        while queue and len(self.active) < limit and self.stop_signal is None:
            got = self.pool.take(f"multigpu sweep {self.folder.root}")
            if got is None:
                break
            run = queue.popleft()
            tries[run.name] += 1
            self.active[run.name] = self._start(run, *got, tries[run.name])
            started = True
        return started

    def _learn_peak(self, ended: specs.Run | None = None) -> None:
        """Auto runs a GPU: the peak memory the runs of this sweep reported, read at most once a
        second from the running ones, and from each run as it ends (short runs may end between)."""
        if self.pool.slots_given is not None or self.pool.kind != "cuda":
            return
        now = time.monotonic()
        if ended is None and now - self._peak_seen_at < 1.0:
            return
        if ended is None:
            self._peak_seen_at = now
        runs = [ended] if ended is not None else [act.run for act in self.active.values()]
        peaks = [r.get("max_memory_gib") for run in runs
                 for r in runfolder.read_metrics(self.folder.run_dir(run.name))]
        peaks = [p for p in peaks if isinstance(p, (int, float))]
        if peaks:
            before = self.pool.slots
            self.pool.learn_peak(max(peaks))
            if self.pool.slots != before:
                self.folder.event(f"runs peak at {self.pool.peak_gib:.2f} GiB of GPU memory: up to "
                                  f"{self.pool.slots} runs a GPU from now on", self.echo)

    def _note_waiting(self, since: float | None) -> float:
        now = time.monotonic()
        if since is None or now - since > 300:
            busy = "; ".join(f"{k}: {why}" for k, why in self.pool.busy().items())
            self.folder.event(f"waiting for {self.pool.per_run} free device(s): {busy or 'none free'}",
                              self.echo)
            return now
        return since

    # ----------------------------------------------------------------------- one run

    def _start(self, run: specs.Run, units: list[Unit], lease, tries: int) -> Active:
        st = self.folder.read_state(run.name) or RunState(run.name, run.params)
        st.attempts += 1
        values = {"out": str(self.folder.run_dir(run.name)), "devices": self.pool.devices_arg(units),
                  "port": str(ports.free_port())}
        if self.pool.kind == "cuda":  # 0 where it shares the GPU: the run's siblings are no one else
            values["min_free_memory"] = "0" if self.pool.slots > 1 else f"{self.pool.min_free_memory:g}"
        values["resume"] = prepare_folder(self.folder, self.spec, run, st.attempts)
        argv = specs.multigpu_prefix(specs.argv_for(self.spec, run, values))
        env = {**os.environ, **self.pool.environment(units), "PYTHONUNBUFFERED": "1"}
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.folder.compile_cache.resolve()))
        log_path = self.folder.run_log(run.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        warm = starter.warm_args(argv, self.pool.per_run) is not None
        how = ", forked from the sweep's warm process" if warm else ""
        with open(log_path, "ab") as log:
            log.write(f"\n=== attempt {st.attempts}, {time.strftime('%Y-%m-%d %H:%M:%S')}, "
                      f"{self.pool.label(units)}{how}: {shlex.join(argv)}\n".encode())
            log.flush()
            cores = [int(u.token) for u in units] if self.pool.kind == "cpu" else None
            proc = self._spawn(argv, env, log, lease.fds(), cores)
        lease.release()  # the child holds the lease now (inherited descriptors)
        st.status, st.started, st.ended, st.exit_code = "running", time.time(), None, None
        st.pid, st.devices, st.note = proc.pid, self.pool.label(units), ""
        self.folder.write_state(st)
        resumed = " (resuming from its checkpoint)" if values["resume"] else ""
        self.folder.event(f"start {run.name} on {st.devices}, attempt {st.attempts}{resumed}",
                          self.echo)
        deadline = time.monotonic() + self.options.timeout_s if self.options.timeout_s else None
        return Active(run, proc, units, deadline, tries=tries)

    def _spawn(self, argv, env, log, keep_fds, cores):
        args = starter.warm_args(argv, self.pool.per_run)
        if args is None:
            return starter.exec_run(argv, env, log, keep_fds, cores)
        if self.warm is None:  # torch loads in the server with the runs' thread count
            self.warm = starter.WarmStarter({k: env[k] for k in ("OMP_NUM_THREADS",) if k in env},
                                            self.warm_preload)
        try:
            return self.warm.start(args, env, log.fileno(), keep_fds, cores)
        except (OSError, EOFError, RuntimeError) as exc:  # the server could not start or fork
            log.write(f"the warm process could not fork the run ({exc}); starting it anew\n".encode())
            log.flush()
            return starter.exec_run(argv, env, log, keep_fds, cores)

    def _finished(self, act: Active, queue) -> bool:
        """Watch one run; True once it has exited (its state written)."""
        code = act.proc.poll()
        now = time.monotonic()
        if code is None:
            if act.deadline is not None and now > act.deadline and act.signalled_at is None:
                act.timed_out = True
                self._signal(act, signal.SIGTERM)
            elif act.signalled_at is not None and now - act.signalled_at > self.options.grace_s:
                self._signal(act, signal.SIGKILL)
            return False
        self.pool.give_back(act.units)
        self._learn_peak(act.run)
        st = self.folder.read_state(act.run.name)
        st.ended, st.exit_code, st.pid = time.time(), code, None
        self._classify(st, act, code)
        if st.status == "failed" and act.tries <= self.options.retries and self.stop_signal is None:
            queue.append(act.run)
            st.note += f"; retrying ({act.tries}/{self.options.retries})"
        self.folder.write_state(st)
        self.report(st)
        self.write_summary()
        return True

    def _classify(self, st: RunState, act: Active, code: int) -> None:
        stopped_by = None
        if self.stop_signal is not None:
            stopped_by = f"stopped by the sweep ({signal.Signals(self.stop_signal).name})"
        classify(st, code, self.folder.run_log(act.run.name), timed_out=act.timed_out,
                 timeout_s=self.options.timeout_s, stopped_by=stopped_by)

    def report(self, st: RunState) -> None:
        """The event line of a run that has ended."""
        took = format_duration(st.duration_s or 0)
        if st.status == "done":
            result = self.result(st)
            absent = absent_metric(runfolder.read_metrics(self.folder.run_dir(st.name)), self.metric())
            value = (f": {absent}" if absent else "") if result.final is None else \
                f": {self.metric()} {result.final:.4g} (best {result.best:.4g})"
            self.folder.event(f"done {st.name} in {took}{value}", self.echo)
        elif st.status == "failed":
            tail = log_tail(self.folder.run_log(st.name))
            indented = "".join(f"\n    {ln}" for ln in tail.splitlines())
            self.folder.event(f"FAILED {st.name} after {took} ({st.note}); its log: "
                              f"{self.folder.run_log(st.name)}{indented}", self.echo)
        else:
            self.folder.event(f"stopped {st.name} after {took}: {st.note}", self.echo)

    # ----------------------------------------------------------------------- stopping

    def _signal(self, act: Active, sig: int) -> None:
        if act.signalled_at is None:
            act.signalled_at = time.monotonic()
        if act.proc.pid <= 0:
            return
        try:
            os.killpg(act.proc.pid, sig)
        except ProcessLookupError:  # a warm run forked an instant ago, not yet in its own session
            try:
                os.kill(act.proc.pid, sig)
            except ProcessLookupError:
                pass

    def _stop_all(self) -> None:
        """Ask every run to stop (they checkpoint), wait for them, kill those past the grace."""
        if self.active:
            self.folder.event(f"stopping {len(self.active)} run(s): each saves a checkpoint "
                              "(Ctrl-C again to kill them now)", self.echo)
        for act in self.active.values():
            self._signal(act, signal.SIGTERM)
        while self.active:
            for name, act in list(self.active.items()):
                if self.force and act.proc.poll() is None:
                    self._signal(act, signal.SIGKILL)
                if self._finished(act, collections.deque()):
                    del self.active[name]
            time.sleep(POLL_SECONDS)

    def _signals(self):
        sweep = self

        class _Handlers:
            def __enter__(self):
                signals = [signal.SIGINT, signal.SIGTERM]
                if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup: stay ignored
                    signals.append(signal.SIGHUP)
                self.old = {s: signal.signal(s, self.on) for s in signals}

            def on(self, signum, _frame):
                if sweep.stop_signal is None:
                    sweep.stop_signal = signum
                else:
                    sweep.force = True

            def __exit__(self, *exc):
                for s, h in self.old.items():
                    signal.signal(s, h)

        return _Handlers()

    # ----------------------------------------------------------------------- results

    def runs_phrase(self) -> str:
        """"18 runs (3 done already, not run again)": a re-run says at once what it skips."""
        done = sum(st.status == "done" for st in self.states())
        return (f"{len(self.runs)} run{'' if len(self.runs) == 1 else 's'}"
                + (f" ({done} done already, not run again)" if done else ""))

    def states(self) -> list[RunState]:
        return [self.folder.read_state(r.name) or RunState(r.name, r.params) for r in self.runs]

    def metric(self) -> str:
        return self.options.metric or default_metric(self.folder, self.runs)

    def result(self, st: RunState) -> RunResult:
        final, best = metric_values(runfolder.read_metrics(self.folder.run_dir(st.name)), self.metric())
        duration = st.duration_s if st.started is not None else None
        return RunResult(st.name, st.params, st.status, duration, final, best, st.attempts, st.note)

    def write_summary(self) -> None:
        with self.folder.summary_lock():
            self._write_summary()

    def _write_summary(self) -> None:
        results = [self.result(st) for st in self.states()]
        write_summary(self.folder.root, results, self.spec.keys(),
                      self.metric(), title=f"sweep {self.folder.root.name}: the best "
                      f"{split_metric(self.metric())[0]} of each run")


def default_metric(folder: SweepFolder, runs: list[specs.Run]) -> str:
    """The train command's validation metric: accuracy, else MAE, else the validation loss, as
    the first run with epochs shows."""
    for run in runs:
        records = runfolder.read_metrics(folder.run_dir(run.name))
        if records:
            keys = records[-1]
            for name in ("val_accuracy", "val_mae", "val_loss", "train_loss"):
                if name in keys:
                    return name
    return "val_loss"
