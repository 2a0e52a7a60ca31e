"""The elastic agent tamed for a launch: what torch's agent does to this process while its
workers run (signal handlers, log output, the wait after a stop signal), set and undone around
each launch (launch.launch)."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from multigpu.launcher.rank import stop_reason
from multigpu.launcher.sessions import (AGENT_STOP_WAIT, RANKS_STOP_WAIT,  # noqa: F401 (theirs)
                                        end_session_left, kill_workers_left, let_the_others_end,
                                        restore_signal_handlers)


class SecondSignalKills:
    """torch's agent answers every stop signal by signalling the workers and waiting up to its
    shutdown timeout (30 s) for them; a second signal should not wait. Its handler is a module
    function that PContext.start installs by name, so we put ours there for the launch (private
    torch API; without it, the agent's wait stands)."""

    def __init__(self):
        self.signals = 0
        self.first_at: float | None = None  # time.monotonic() of the first signal

    def waited_out(self, wait: float) -> bool:
        """Whether the agent's wait after the first signal (`wait` s: its shutdown timeout) ran
        out: then it killed the ranks that had not stopped, maybe in the middle of a checkpoint."""
        return self.first_at is not None and time.monotonic() - self.first_at >= 0.97 * wait

    def __enter__(self):
        from torch.distributed.elastic.multiprocessing import api

        self._api, self._original = api, getattr(api, "_terminate_process_handler", None)
        if self._original is not None:
            api._terminate_process_handler = self._handler
        return self

    def _handler(self, signum, frame):
        self.signals += 1
        if self.first_at is None:
            self.first_at = time.monotonic()
        if self.signals > 1:
            kill_workers_left()
        self._original(signum, frame)

    def __exit__(self, *exc):
        if self._original is not None:
            self._api._terminate_process_handler = self._original


class AttemptClose:
    """What the launcher adds to torch's agent closing an attempt (its ranks' SubprocessContext:
    after a failure, before a `--max-restarts` restart, at the launch's end; private torch API,
    wrapped for the launch; without it, torch's behaviour):

    - before the agent's SIGTERM to the ranks of an attempt that failed, and that the launcher was
      not asked to stop (`asked_to_stop()`), which local ranks ended and how, where the ranks can
      read it (stop_reason): the SIGTERM is then said as the peer's failure, not as a stop asked for;
    - after it, what is left of each failed or stopped rank. torch ends the process group of the
      ranks still running only, and a group holds only part of what a rank started: a rank that
      died (kill -9, the OOM killer, a crash) leaves its children to live on. Most notice and
      exit, not all, nor at once: loader workers started through a fork server hold the server
      alive, and it them; the loader workers of `--auto` and of multigpu's loaders
      (core/loading/loader_workers.py) sit in process groups of their own and look for their parent only
      every few seconds, into the next attempt, and only between items. The session of each rank
      that did not end with 0 (torch starts each rank in one of its own, and they stay in it) is
      ended with SIGKILL."""

    def __init__(self, asked_to_stop: Callable[[], bool] = lambda: False,
                 ranks_stop_together: bool = False):
        self.asked_to_stop, self.ranks_stop_together = asked_to_stop, ranks_stop_together
        self.exit_codes: dict[int, int | None] = {}  # local rank -> exit code, at the last close

    def __enter__(self):
        from torch.distributed.elastic.multiprocessing import api

        self._cls = getattr(api, "SubprocessContext", None)
        self._original = self._cls.__dict__.get("_close") if self._cls is not None else None
        if self._original is not None:
            original, hooks = self._original, self

            def close(pcontext, *args, **kwargs):
                handlers = getattr(pcontext, "subprocess_handlers", {})
                ended = {rank: h.proc.returncode for rank, h in handlers.items()
                         if h.proc.poll() not in (None, 0)}
                if stop_reason.all_stopped_by_signal(ended.values()):
                    if hooks.ranks_stop_together and not hooks.asked_to_stop():
                        let_the_others_end([h.proc for h in handlers.values()], RANKS_STOP_WAIT)
                    ended = {}  # a stop on a signal, not a failure to say
                if ended and not hooks.asked_to_stop():
                    stop_reason.write(getattr(pcontext, "error_files", {}), ended)
                if hooks.asked_to_stop():  # the agent passes the launcher's stop signal on
                    sig = kwargs.get("death_sig", args[0] if args else None)
                    if sig is not None:
                        stop_reason.mark_forwarded(getattr(pcontext, "error_files", {}), sig)
                try:
                    return original(pcontext, *args, **kwargs)
                finally:  # the ranks that failed, died or were stopped by the agent
                    hooks.exit_codes = {rank: h.proc.poll() for rank, h in handlers.items()}
                    for h in handlers.values():
                        if h.proc.poll() not in (None, 0):
                            end_session_left(h.proc.pid)
            self._cls._close = close
        return self

    def __exit__(self, *exc):
        if self._original is not None:
            self._cls._close = self._original


class RanksStopTogether:
    """Ranks of an attempt that all stopped on a stop signal sent to one of them (see
    sessions.let_the_others_end) asked for a stop: torch's agent would start them again under
    --max-restarts (private torch API, its check of the workers wrapped for the launch; without
    it, torch's behaviour). Enter it before RestartsSaid, which then says no restart."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

        self._cls, self._original = LocalElasticAgent, LocalElasticAgent.__dict__.get("_monitor_workers")
        if self.enabled and self._original is not None:
            original = self._original

            def monitor(agent, worker_group):
                result = original(agent, worker_group)
                failures = result.failures if result.is_failed() else {}
                if stop_reason.all_stopped_by_signal(f.exitcode for f in failures.values()):
                    agent._remaining_restarts = 0  # a stop asked for: the agent ends the launch
                return result
            LocalElasticAgent._monitor_workers = monitor
        return self

    def __exit__(self, *exc):
        if self.enabled and self._original is not None:
            self._cls._monitor_workers = self._original


@contextlib.contextmanager
def quiet_torchelastic():
    """torchrun logs its own banners and failure dumps; we print one summary instead."""
    import logging

    # torch's elastic modules set a level on their own loggers, so the parent's is not enough.
    names = ["torch.distributed.elastic"] + [n for n in logging.root.manager.loggerDict
                                              if n.startswith("torch.distributed.elastic.")]
    saved = {n: logging.getLogger(n).level for n in names}
    if not os.environ.get("MULTIGPU_DEBUG"):
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
