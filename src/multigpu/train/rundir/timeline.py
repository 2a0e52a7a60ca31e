"""Where a `multigpu train` job's wall time went, said once at its end on rank 0, e.g.

    time: 4.6 s since the command: 3.7 s starting (launcher 1.3, workers' start 0.1, imports 1.3,
    process group 0.0, data 0.0, model 0.0, prepare 0.9, optimizer 0.0, config 0.0, resume 0.0,
    logs 0.0; meanwhile in a thread: compiler's modules 0.5 during prepare, compiler 0.4 during
    prepare), first step done at 3.7 s (0.0 s waiting for data), 0.1 s training, 0.1 s
    evaluating, 0.0 s held up by checkpoints, 0.8 s other (metrics, plot)

(`--model linear --data synthetic:256 --epochs 2 --devices cpu:2` on a 2-core CPU, where the
thread's imports compete with the other rank's for the cores: DDP's wrapping waited for them.)

The clock starts when the `multigpu train` command starts (the CLI puts the time in STARTED_ENV,
which the launched workers inherit), so the start-up counts as the user waits for it; a worker
started some other way counts from the start of its training. The start-up is split where it
happens: launch (the command until this worker's own `multigpu` command began, at the CLI's
first line), said in two parts where the launcher said when it handed over to torchrun's agent:
launcher (its imports, torch's among them, and checks) and workers' start (the rendezvous, the
processes' start, Python's own), then imports (from there until its training began), then the parts
the training marks as it passes them (process group, decoder, data, model, loaders (a fresh run's
loader workers started, before or after the model), prepare, optimizer, config, resume, logs:
training.build_job and trainloop say which). These follow each other and add
up to the start-up. Parts done in a thread meanwhile (head_start.py: the decoder, the folder's
listing, the compiler's import) come after them, each with the parts of the line it overlapped
(`compiler 0.9 during prepare`): "data" and "prepare" are then the time the run waited for them.
Then when the first optimizer step was done, counted from the command (the start-up as the user sees
it: the loader workers' first batches and the step's own first run are in it), and how long of
that the loop waited for the step's batches (the loader's start and its workers' in it: the rest is
the step's own first run). It stops at this
line: the processes' teardown and exit come after it. A run that stops early (a signal, an error)
ends with its own message instead. Pure: no torch.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from multigpu.launcher.launch_options import AGENT_STARTED_ENV

STARTED_ENV = "MULTIGPU_STARTED_AT"
PARTS = ("training", "evaluating", "checkpoints")


def mark_command_start(started: float, env=os.environ) -> None:
    """In the command the user typed (not in its workers): its start, for every process it launches."""
    env[STARTED_ENV] = repr(started)


def command_start(env=os.environ) -> float | None:
    """time.time() when the command started (STARTED_ENV), or None for a process without it."""
    return _env_time(STARTED_ENV, env)


def agent_start(env=os.environ) -> float | None:
    """time.time() when the launcher handed over to torchrun's agent, or None."""
    return _env_time(AGENT_STARTED_ENV, env)


def _env_time(name: str, env) -> float | None:
    try:
        return float(env[name])
    except (KeyError, ValueError):
        return None


@dataclass
class Timeline:
    """`started`: the command's start (None: now, the start-up then is this process's alone);
    `process`: this process's command's start, which splits the time before now into launch and
    imports (the command's own process: imports only); `restarts`: attempts of the launch before
    this one (torchrun's restart count), whose time is in the launch; `agent`: when the launcher
    handed over to torchrun's agent, which splits the launch."""
    started: float | None = field(default_factory=command_start)
    process: float | None = None
    restarts: int = 0                               # earlier attempts of the launch (in "launch")
    agent: float | None = field(default_factory=agent_start)  # when the agent took over
    ready: float | None = None                      # time.time() when training could begin
    first_step: float | None = None                 # time.time() when the first step was done
    first_wait: float | None = None                 # seconds the loop waited for the first step's batches
    seconds: dict = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    starting: dict = field(default_factory=dict)    # the start-up's parts, in the order marked
    spans: list = field(default_factory=list)       # (part, start, end) of each mark
    beside: list = field(default_factory=list)      # (part, start, end) done in a thread meanwhile

    def __post_init__(self) -> None:
        now = time.time()
        if self.started is None:
            self.started = now
        elif self.process is not None and self.process <= self.started:  # one process: no launch
            self.starting = {"imports": now - self.started}
        elif self.process is not None:
            self.starting = self._launch_and_imports(now)
        else:
            self.starting = {"launch, imports": now - self.started}
        self._last = now

    def _launch_and_imports(self, now: float) -> dict:
        """The command until this worker's command began (split where the agent took over, when
        the launcher said so and this is the launch's first attempt), then until now."""
        launch = min(self.process - self.started, now - self.started)
        imports = now - self.started - launch
        if n := self.restarts:
            return {f"launch and {n} earlier attempt{'s' if n > 1 else ''}": launch, "imports": imports}
        if self.agent is not None and self.started <= self.agent <= self.started + launch:
            launcher = self.agent - self.started
            return {"launcher": launcher, "workers' start": launch - launcher, "imports": imports}
        return {"launch": launch, "imports": imports}

    def mark(self, part: str) -> None:
        """The start-up's `part` ended now (it began where the last mark ended)."""
        now = time.time()
        self.starting[part] = self.starting.get(part, 0.0) + now - self._last
        self.spans.append((part, self._last, now))
        self._last = now

    def meanwhile(self, part: str, start: float, end: float) -> None:
        """A part a thread did from `start` to `end` (time.time()) while the marked ones went on
        (called from that thread: one append)."""
        self.beside.append((part, start, end))

    def mark_ready(self, part: str) -> None:
        """The start-up's last `part` ended now: training can begin."""
        self.mark(part)
        self.ready = self._last

    def stepped(self) -> None:
        """An optimizer step ended now: the first one's time is said."""
        if self.first_step is None:
            self.first_step = time.time()

    def waited_first(self, seconds: float) -> None:
        """The loop had waited `seconds` for the batches of its first step (the loader's start,
        its workers', in them): said beside the first step's time. Only the first call counts."""
        if self.first_wait is None:
            self.first_wait = seconds

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds

    def summary(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        whole = now - self.started
        start = (self.ready or now) - self.started
        s = self.seconds
        other = whole - start - sum(s.values())
        parts = ", ".join(f"{name} {sec:.1f}" for name, sec in self.starting.items())
        if self.beside:
            parts += "; meanwhile in a thread: " + ", ".join(
                f"{name} {end - begin:.1f}{self._during(begin, end)}" for name, begin, end in self.beside)
        first = ""
        if self.first_step:
            wait = f" ({self.first_wait:.1f} s waiting for data)" if self.first_wait is not None else ""
            first = f"first step done at {self.first_step - self.started:.1f} s{wait}, "
        return (f"time: {whole:.1f} s since the command: {start:.1f} s starting ({parts}), {first}"
                f"{s['training']:.1f} s training, {s['evaluating']:.1f} s evaluating, "
                f"{s['checkpoints']:.1f} s held up by checkpoints, {other:.1f} s other "
                "(metrics, plot)")

    def _during(self, begin: float, end: float) -> str:
        """' during A + B': the marked parts that overlapped [begin, end] by 0.05 s or more (the
        line's rounding), else the one that overlapped most; '' when none did."""
        overlaps = {}
        for name, start, stop in self.spans:
            overlaps[name] = overlaps.get(name, 0.0) + max(0.0, min(end, stop) - max(begin, start))
        names = [name for name, sec in overlaps.items() if sec >= 0.05]
        if not names and overlaps and max(overlaps.values()) > 0:
            names = [max(overlaps, key=overlaps.get)]
        return f" during {' + '.join(names)}" if names else ""
