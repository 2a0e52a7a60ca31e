"""How a sweep starts a run's process: exec'd, or forked from a warm parent that has imported
torch once, so that each small `multigpu train` run skips the imports.

A small run of `multigpu train` spends more time starting than training: a fresh interpreter
imports multigpu, torch, torch._dynamo (the first optimizer step pulls it in) and matplotlib,
about 4 s of CPU a run, and on a machine with few cores the runs of a sweep pay it one after
another. Python's multiprocessing forkserver (part of the standard library) keeps one process that
has imported all of that once; each run is forked from it and calls the same `multigpu` main an
exec'd run would, with the same argv, environment, folder and log. Only a run that is one process
(one device) goes this way: a run of several processes starts its workers through the launcher,
as before.

What a run sees is what an exec'd run sees:
- its own session (setsid), so the sweep's SIGTERM to the process group reaches it and a Ctrl-C
  in the terminal reaches only the sweep;
- SIGTERM when its parent dies (PR_SET_PDEATHSIG): its parent is the fork server, which the
  kernel kills with the sweep, even a sweep killed with -9 (forkserver_init.py: left to exit by
  itself, the server would take seconds, tearing down what it preloaded, while its runs train on);
- the environment the sweep gives it, its CPU cores, stdin from /dev/null, stdout and stderr into
  its log, unbuffered; the device leases, passed over the server's socket (the same open files,
  so the same flocks);
- multiprocessing's start method unset (the platform's default), so loader workers are started
  as an exec'd run starts them;
- exit status: main's return value, -N for death by signal N, 1 for an uncaught exception (its
  traceback in the log), exit handlers run.

Hazards: the server must never initialise CUDA (a forked CUDA context is unusable) nor start
threads before forking; `warm_check` below is what the child verifies, and nothing in the
preloaded modules does either at import. torch reads OMP_NUM_THREADS when it loads, so the child
sets the thread count from its own environment.

Every other run (another program, `multigpu run`, several devices a run), and every run when
MULTIGPU_SWEEP_COLD_START=1 is set, is exec'd with subprocess: its own session, SIGTERM when the
sweep dies, pinned to its cores (child_setup).
"""
from __future__ import annotations

import atexit
import io
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import traceback

from multigpu.core.system.environ import environ_set
from multigpu.core.system.orphans import alive, set_death_signal

# Imported first by the fork server, before the modules the sweep's caller names (what a
# `multigpu train` run imports: cli/sweep.py's WARM_PRELOAD, the CLI's own modules among them,
# named from the layer that owns them): what makes the server die with the sweep.
SERVER_FIRST = "multigpu.sweep.forkserver_init"
COLD_START_ENV = "MULTIGPU_SWEEP_COLD_START"
SWEEP_PID_ENV = "MULTIGPU_SWEEP_PID"  # the server's alone: whose death kills it (forkserver_init)


def warm_args(argv: list[str], devices_per_run: int) -> list[str] | None:
    """The `multigpu` arguments of a run that can start warm, else None: `multigpu train` (as
    spec.multigpu_prefix wrote it, with this interpreter) on one device."""
    head = [sys.executable, "-P", "-m", "multigpu", "train"]
    if devices_per_run != 1 or argv[: len(head)] != head or os.environ.get(COLD_START_ENV) == "1":
        return None
    return argv[4:]


def exec_run(argv: list[str], env: dict, log, keep_fds: list[int], cores: list[int] | None):
    """The run as a new program (subprocess.Popen), or a handle that ends at once as exit 127
    (a shell's "command not found") when it cannot start."""
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, pass_fds=keep_fds,
                                preexec_fn=child_setup(cores))
    except (OSError, subprocess.SubprocessError) as exc:  # e.g. made non-executable since
        log.write(f"cannot start {argv[0]}: {exc.strerror or exc}\n".encode())
        return _Failed()


class _Failed:
    """A run whose process could not be started: it ends at once, as exit 127."""
    pid = -1

    def poll(self) -> int:
        return 127


def child_setup(cores: list[int] | None):
    """In the child, before exec: SIGTERM when the sweep dies; pinned to its cores (CPU runs)."""
    parent = os.getpid()

    def setup():
        set_death_signal(signal.SIGTERM)
        if os.getppid() != parent:  # the sweep died before prctl: no signal would come
            os._exit(143)
        if cores is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
    return setup


class _Fd:
    """A file descriptor that crosses to the forked run over the server's socket (SCM_RIGHTS:
    the same open file, so a lease's flock goes with it)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


class WarmRun:
    """The handle the scheduler watches, like a Popen: `pid` and `poll()`."""

    def __init__(self, process):
        self._process, self.pid = process, process.pid

    def poll(self) -> int | None:
        code = self._process.exitcode
        if code is not None:
            self._process.close()  # its sentinel and pipe
            self.poll = lambda: code
        return code


class WarmStarter:
    """One fork server for the sweep, started at the first run with the environment `server_env`
    adds (e.g. OMP_NUM_THREADS, read by torch as it loads), having imported `preload`."""

    def __init__(self, server_env: dict[str, str] | None = None, preload: tuple[str, ...] = ()):
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload([SERVER_FIRST, *preload])
        # is_available() through NVML there, should anything ask: the CUDA runtime's own count
        # initialises the driver, and a fork of that cannot use the GPU
        self._server_env = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **(server_env or {}),
                            SWEEP_PID_ENV: str(os.getpid())}
        self._running = False

    def _ensure_server(self) -> None:
        if self._running:
            return
        from multiprocessing import forkserver

        with environ_set(self._server_env):
            forkserver.ensure_running()
        self._running = True

    def start(self, args: list[str], env: dict[str, str], log_fd: int, keep_fds: list[int],
              cores: list[int] | None) -> WarmRun:
        """`multigpu ARGS` in a forked child; `keep_fds` (leases) stay open in it."""
        self._ensure_server()
        process = self._ctx.Process(
            target=run_child, name="multigpu-run",
            args=(list(args), dict(env), _Fd(log_fd), [_Fd(fd) for fd in keep_fds], cores,
                  os.getpid()))
        process.start()
        return WarmRun(process)


def run_child(args, env, log_fd: int, keep_fds: list[int], cores, sweep_pid: int) -> None:
    """The run, in the forked child: set up as an exec'd run would be, then multigpu's main."""
    os.setsid()
    _let_go_of_the_server()
    set_death_signal(signal.SIGTERM)  # when the fork server goes: it is killed with the sweep
    if not alive(sweep_pid):  # the sweep died before the line above: no signal would come
        os._exit(143)
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    for fd in keep_fds:
        os.set_inheritable(fd, True)  # as pass_fds: a process the run starts holds them too
    _redirect(log_fd)
    os.environ.clear()
    os.environ.update(env)
    # multiprocessing's start method unset again, as in an exec'd run (fork, on Linux): the
    # server's child is set to forkserver, and loader workers started through a server of the
    # run's own watch that server, not the run, so they outlived a run killed with -9
    multiprocessing.set_start_method(None, force=True)
    code = 1
    try:
        warm_check()
        sys.argv = ["multigpu", *args]
        # `python -m multigpu ARGS`, the program the run's command names (spec.multigpu_prefix),
        # run as an exec'd run runs it: by name, not imported (pyproject's layer contract says why)
        runpy.run_module("multigpu", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # as the interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # noqa: SLF001 - an exec'd run's interpreter runs them at exit
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(code if 0 <= code < 256 else 1)


def _let_go_of_the_server() -> None:
    """multiprocessing gives each forked child the sweep's end of the pipe whose closing tells the
    fork server that the sweep is gone (so that a child could fork more); a run that kept it
    would keep the server alive past a sweep killed with -9, and the server's death, which ends
    the runs (PR_SET_PDEATHSIG), would never come."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # noqa: SLF001 - the same object _serve_one filled in
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


def warm_check() -> None:
    """What the fork must not have inherited: a CUDA context, and the thread count torch chose
    from the server's environment rather than the run's."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("multigpu sweep: the fork server initialised CUDA; a run forked from it "
                           "cannot use the GPU")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _redirect(log_fd: int) -> None:
    """stdin from /dev/null, stdout and stderr to the log, unbuffered (PYTHONUNBUFFERED)."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  errors="backslashreplace")
