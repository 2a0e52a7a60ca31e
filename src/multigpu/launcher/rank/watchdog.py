"""The in-worker watchdog: names the ranks of a hung job, and ends workers whose launcher is gone.

Started in every worker of a multigpu launch (`multigpu train`, and scripts under `multigpu run`
through multigpu.launcher.rank.worker), it runs two daemon threads: one checks 2 every POLL_SECONDS, the
other 3 every second or so (a store call that blocks never delays the others):

1. **Orphans.** orphans.py watches the launcher from the worker's first line; the watchdog hands
   it `on_orphan` (a user's script: SIGTERM to itself; the training loop hands its own once
   training has begun) and stops looking at the store once the launcher, its host, is gone.
2. **Changed variables.** A script that sets MASTER_PORT, MASTER_ADDR, WORLD_SIZE, RANK or
   LOCAL_RANK itself (post 002 does) is named at once, with the value multigpu had set.
3. **Hangs** (several ranks, `--hang-timeout` > 0). A rank is *stalled* when neither its progress
   count (beats: every optimizer step, through torch's global step hook, and `beat()`) nor its main
   thread's Python stack has changed for the timeout, and its main thread was not computing (its
   CPU time stood still; with NCCL this is not asked, since a host waiting for the GPU spins). Every
   rank posts its state to the job's TCPStore; when every rank is stalled, finished or gone
   (silent), the job is hung (a rank still moving means the others wait for it, not a hang), and the
   first rank to see it trips: every rank writes its stack (all threads) to
   <log dir>/hang-rank<r>.txt, dumps torch's NCCL flight recorder there when NCCL is in use, and
   exits with EXIT_HANG; the summary (which rank was where, for how long, what the script changed)
   goes to each rank's stderr and torchelastic error file, so the launcher prints it.

A slow first step or compile does not trip it: the ranks' stacks change while they compile, and
ranks waiting for a slower one are not all stalled.

Private torch API used: `torch._C._distributed_c10d._dump_nccl_trace` (or `_dump_fr_trace`) to
dump the flight recorder on demand; there is no public call for it (only dump-on-timeout).
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import os
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable

from multigpu.core.system import fileio, orphans

HANG_TIMEOUT_ENV = "MULTIGPU_HANG_TIMEOUT"
LOG_DIR_ENV = "MULTIGPU_LOG_DIR"
DEFAULT_HANG_TIMEOUT = 300.0
EXIT_HANG = 124
ORPHAN_GRACE_SECONDS = orphans.GRACE_SECONDS
POLL_SECONDS = 0.2  # how soon a changed variable is seen
REPORT_WAIT_SECONDS = 5.0
HANG_HEADER = "hang: "
WATCHED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")
_LIBRARY_DIRS = tuple({os.path.dirname(os.__file__), os.path.dirname(threading.__file__)})


class StoreNotThere(ConnectionError):
    """Nothing listens where the job's key-value store should be (yet, or any more)."""


def start_from_env(*, on_orphan: Callable[[], None] | None = None) -> Watchdog | None:
    """In a worker started by multigpu's launcher, start the watchdog; None elsewhere.
    `on_orphan`: what a dead launcher makes this worker do (orphans.on_orphan); None: leave that
    as it is (a worker still starting up exits at once)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or HANG_TIMEOUT_ENV not in os.environ:
        return None
    dog = Watchdog(timeout=float(os.environ[HANG_TIMEOUT_ENV]), on_orphan=on_orphan)
    dog.start()
    return dog


class Watchdog:
    def __init__(self, *, timeout: float, on_orphan: Callable[[], None] | None = None):
        env = os.environ
        self.rank, self.world_size = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        self.timeout, self.on_orphan = timeout, on_orphan
        self.interval = min(1.0, max(timeout / 10, 0.2)) if timeout > 0 else 1.0
        self.log_dir = Path(env[LOG_DIR_ENV]) if env.get(LOG_DIR_ENV) else None
        self.ours = {k: env.get(k) for k in WATCHED_ENV}
        self.changed: dict[str, tuple[str | None, str | None]] = {}
        self.prefix = (f"multigpu/watchdog/{env.get('TORCHELASTIC_RUN_ID', '')}/"
                       f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        self._main = threading.main_thread().ident
        self._main_native = threading.main_thread().native_id
        self._cpu: tuple[float, float | None] | None = None
        self._beats = 0
        self._seen = (0, ())           # (beats, stack) at the last change
        self._since = time.monotonic()  # when that was
        self._store = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def beat(self) -> None:
        self._beats += 1

    def start(self) -> None:
        orphans.watch_from_env()  # already watching when started from the worker's first line
        if self.on_orphan is not None:
            orphans.on_orphan(self.on_orphan)
        watching = self.timeout > 0 and self.world_size > 1
        if watching:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(lambda *_: self.beat())
            atexit.register(self._post, "finished")
        # Two threads: the variables' check must never wait behind the store, whose calls can
        # block for seconds when the launcher (its host) has just died.
        self._threads = [threading.Thread(target=self._watch_env, name="multigpu-watchdog",
                                          daemon=True)]
        if watching:
            self._threads.append(threading.Thread(target=self._watch_hangs, daemon=True,
                                                  name="multigpu-watchdog-hangs"))
        for thread in self._threads:
            thread.start()
        # Joined before the interpreter finalizes: a daemon thread still inside a TCPStore call
        # then is ended by pthread_exit, which unwinds through C++ and aborts the process
        # ("terminate called without an active exception", SIGABRT: a finished script's rank
        # reported as failed). atexit runs last-registered first, so this runs before _post.
        atexit.register(self.stop, join=True)

    def stop(self, join: bool = False) -> None:
        self._stop.set()
        if not join:
            return
        for thread in self._threads:
            if thread is not threading.current_thread():
                # Orphaned, the store is gone and the worker must end soon: no long wait for it.
                thread.join(timeout=1.0 if self._launcher_gone() else 2 * REPORT_WAIT_SECONDS + 5)

    def _launcher_gone(self) -> bool:
        return orphans.gone()

    # --- the loops --------------------------------------------------------------------------------
    def _watch_env(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            self._check_env()

    def _watch_hangs(self) -> None:
        while not self._stop.wait(self.interval) and not self._launcher_gone():
            try:
                self._check_hang()
            except StoreNotThere:  # not listening yet (with --max-restarts, rank 0 hosts it
                continue           # once its script has made the group), or gone with the launcher
            except Exception:  # the store is gone (its host died): the launcher acts now
                return

    def _check_env(self) -> None:
        for key, ours in self.ours.items():
            now = os.environ.get(key)
            if now != ours and self.changed.get(key, (None, ours))[1] != now:
                self.changed[key] = (ours, now)
                _say(f"rank {self.rank}: the script set {key}={now} (multigpu had set {ours}); "
                     f"ranks that disagree on it never meet: leave {key} to the launcher")

    def _check_hang(self) -> None:
        now = time.monotonic()
        stack = main_stack(self._main)
        busy = self._busy(now)
        if (self._beats, stack) != self._seen or busy:
            self._seen, self._since = (self._beats, stack), now
        stalled = now - self._since
        store = self._connect()
        store.set(f"{self.prefix}/status/{self.rank}", json.dumps(
            {"t": time.time(), "stalled": stalled, "where": where(stack), "state": "running",
             "changed": self.changed}))
        if store.check([f"{self.prefix}/trip"]):
            self._trip(store)
        elif stalled >= self.timeout and hung(self._statuses(store), time.time(), self.timeout,
                                               3 * self.interval + 5):
            if store.add(f"{self.prefix}/trips", 1) == 1:
                store.set(f"{self.prefix}/trip", str(self.rank))
                self._trip(store)

    def _busy(self, now: float) -> bool:
        """Whether the main thread used the CPU for most of the last interval: computing, not
        waiting. Not asked under NCCL, where a host waiting for the GPU spins at full CPU."""
        cpu = _thread_cpu_seconds(self._main_native)
        last, self._cpu = self._cpu, (now, cpu)
        if cpu is None or last is None or last[1] is None or _uses_nccl():
            return False
        return cpu - last[1] >= 0.5 * (now - last[0])

    # --- tripping ---------------------------------------------------------------------------------
    def _trip(self, store) -> None:
        self._dump_stacks()
        store.set(f"{self.prefix}/report/{self.rank}", "1")
        tripper = int(store.get(f"{self.prefix}/trip"))
        if tripper == self.rank:
            deadline = time.monotonic() + REPORT_WAIT_SECONDS
            keys = [f"{self.prefix}/report/{r}" for r in range(self.world_size)]
            while time.monotonic() < deadline and not store.check(keys):
                time.sleep(0.1)
            store.set(f"{self.prefix}/summary", summarize(self._statuses(store), time.time(),
                                                          self.timeout, 3 * self.interval + 5))
        try:
            store.wait([f"{self.prefix}/summary"], datetime.timedelta(seconds=2 * REPORT_WAIT_SECONDS))
            summary = store.get(f"{self.prefix}/summary").decode()
        except Exception:
            summary = (f"{HANG_HEADER}no progress for {self.timeout:g} s (--hang-timeout); "
                       "the other ranks did not answer")
        if self.log_dir is not None:  # the launcher prints it; each rank keeps it with its stack
            with open(self.log_dir / f"hang-rank{self.rank}.txt", "a") as f:
                f.write("\n" + summary + "\n")
        write_error_file(summary)
        os._exit(EXIT_HANG)

    def _dump_stacks(self) -> None:
        if self.log_dir is None:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"hang-rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank} (pid {os.getpid()}), stalled for "
                    f"{time.monotonic() - self._since:.0f} s; every thread's stack:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        dump_flight_recorder(self.log_dir / f"nccl_trace_rank{self.rank}.pkl")

    def _statuses(self, store) -> dict[int, dict | None]:
        keys = [f"{self.prefix}/status/{r}" for r in range(self.world_size)]
        out = {}
        for r, key in enumerate(keys):
            out[r] = json.loads(store.get(key)) if store.check([key]) else None
        return out

    def _connect(self):
        if self._store is None:
            from multigpu.core.distributed import launcher_store

            self._store = launcher_store(self.ours["MASTER_ADDR"] or "127.0.0.1",
                                         self.ours["MASTER_PORT"], 5.0)
            if self._store is None:
                raise StoreNotThere("the launcher's store does not answer")
        return self._store

    def _post(self, state: str) -> None:
        if self._launcher_gone():  # the launcher's store went with it
            return
        try:
            self._connect().set(f"{self.prefix}/status/{self.rank}", json.dumps(
                {"t": time.time(), "stalled": 0, "where": "", "state": state, "changed": self.changed}))
        except Exception:
            pass


# --- pure parts: the decision and the words ------------------------------------------------------

def main_stack(thread_id: int | None) -> tuple[tuple[str, int, str], ...]:
    """(file, line, function) of every frame of a thread, outermost first."""
    frame = sys._current_frames().get(thread_id)
    frames = []
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return tuple(reversed(frames))


def _is_library(filename: str) -> bool:
    return ("site-packages" in filename and "/multigpu/" not in filename) or \
        filename.startswith(_LIBRARY_DIRS) or filename.startswith("<")


def where(stack) -> str:
    """'in all_reduce (torch) called from train.py:10 in main', or 'train.py:14 in wait'."""
    if not stack:
        return "no Python frame"
    user = next((f for f in reversed(stack) if not _is_library(f[0])), None)
    inner = stack[-1]
    here = f"{os.path.basename(user[0])}:{user[1]} in {user[2]}" if user else ""
    if user is None or inner == user:
        return here or f"{os.path.basename(inner[0])}:{inner[1]} in {inner[2]}"
    lib = "torch" if f"{os.sep}torch{os.sep}" in inner[0] else os.path.basename(inner[0])
    return f"in {inner[2]} ({lib}) called from {here}"


def hung(statuses: dict[int, dict | None], now: float, timeout: float, silent_after: float) -> bool:
    """Every rank stalled for the timeout, finished, or silent; at least one of them stalled."""
    stalled = 0
    for s in statuses.values():
        if s is None or now - s["t"] > silent_after or s["state"] == "finished":
            continue
        if s["stalled"] < timeout:
            return False
        stalled += 1
    return stalled > 0


def summarize(statuses: dict[int, dict | None], now: float, timeout: float, silent_after: float) -> str:
    lines = [f"{HANG_HEADER}no rank made progress for {timeout:g} s (--hang-timeout {timeout:g}); "
             "each rank's stack is in hang-rank<N>.txt beside the logs"]
    for rank, s in sorted(statuses.items()):
        if s is None or (s["state"] != "finished" and now - s["t"] > silent_after):
            lines.append(f"rank {rank}: gone (its process ended or stopped answering)")
            continue
        if s["state"] == "finished":
            lines.append(f"rank {rank}: finished its script while the others waited for it")
            continue
        lines.append(f"rank {rank}: stuck {s['stalled']:.0f} s {s['where']}")
        for key, (ours, theirs) in (s.get("changed") or {}).items():
            lines.append(f"rank {rank}: its script set {key}={theirs}; multigpu had set {ours}: "
                         f"leave {key} to the launcher")
    return "\n".join(lines)


def _thread_cpu_seconds(native_id: int | None) -> float | None:
    try:
        import psutil

        return next((t.user_time + t.system_time for t in psutil.Process().threads()
                     if t.id == native_id), None)
    except Exception:
        return None


def _uses_nccl() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist and dist.is_initialized() and dist.get_backend() == "nccl")
    except Exception:
        return False


def dump_flight_recorder(path: Path) -> bool:
    """Write torch's NCCL flight recorder to `path` when NCCL is in use (private API, see top)."""
    try:
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        if not (dist.is_initialized() and dist.get_backend() == "nccl"):
            return False
        dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
        if dump is None:
            return False
        path.write_bytes(dump())
        return True
    except Exception:
        return False


def write_error_file(message: str) -> bool:
    """Under the launcher, the message torchrun's agent hands it for this rank (its per-worker
    error file, in its plain form: a message and a time); whether it was written. Atomic: the
    agent stops the other ranks as soon as one exits, maybe in the middle of this write, and a
    cut-off file breaks its report."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    try:
        fileio.atomic_write_text(path, json.dumps({"message": message, "timestamp": int(time.time())}))
    except OSError:
        return False
    return True


def _say(message: str) -> None:
    for line in message.splitlines():
        print(f"multigpu: {line}", file=sys.stderr, flush=True)
