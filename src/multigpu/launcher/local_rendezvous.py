"""Where the ranks of one machine meet, and what each is told (local_loop).

The launcher holds a fresh TCPStore for each attempt, on 127.0.0.1, its port picked by the kernel
while the socket is bound (no pick-then-bind race: many jobs can start at once), and tells every
rank to join it as a client: TORCHELASTIC_USE_AGENT_STORE=True makes init_process_group(env://)
connect to MASTER_ADDR:MASTER_PORT without hosting a store of its own (torch.distributed.
rendezvous; the keys are not prefixed by the attempt, so each attempt gets a new store). The
ranks' environment is the one torch's LocalElasticAgent gives a worker (its _start_workers, torch
2.13), so scripts written for torchrun see no difference. Public torch API only.

The store comes in two steps (LoopbackStore): its socket bound and listening before the ranks
start (no torch), then served once they are started, so that the launcher's import of torch and
the ranks' own go on at once (on an idle 2-core machine `multigpu run` of 2 CPU processes was
0.7-1.1 s shorter).
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass

from multigpu.launcher.rank.stop_reason import STOP_SIGNALS

LOOPBACK = "127.0.0.1"
ROLE = "default"  # torchrun's role name for its workers


class LoopbackStore:
    """The store of one attempt, in two steps, so that the ranks start before the launcher
    imports torch: the socket bound at once (torch-free: 127.0.0.1, port 0 so the kernel picks,
    listening), the ranks told its port; then `serve()` (torch) hands the socket to a TCPStore
    server (master_listen_fd). A rank that comes first waits in the socket's backlog: its
    client's connect is taken by the kernel, its first query answered once the store serves."""

    def __init__(self, timeout_s: int = 300):
        self.timeout_s = timeout_s
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.bind((LOOPBACK, 0))
            self.sock.listen(1024)
        except OSError:
            self.sock.close()
            raise
        self.port: int = self.sock.getsockname()[1]
        self.store = None

    def serve(self):
        """The TCPStore on the bound socket (one torch creates binds every interface); where
        this torch cannot take a socket, one of its own on the same port (every interface)."""
        if self.store is not None:
            return self.store
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            self.store = TCPStore(LOOPBACK, self.port, is_master=True, multi_tenant=True,
                                  timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=self.sock.fileno())
        except (TypeError, RuntimeError, ValueError, OSError):
            self.sock.close()
            self.store = TCPStore(LOOPBACK, self.port, is_master=True, wait_for_workers=False,
                                  timeout=timeout)
            return self.store
        self.sock.detach()  # the store owns the socket now
        return self.store

    def close(self) -> None:
        """The socket closed where no store took it (the attempt ended before it served)."""
        if self.store is None:
            self.sock.close()


def ranks_store(timeout_s: int = 300):
    """(store, port) the ranks of one attempt meet at: a LoopbackStore, its port bound and
    listening, served (torch imported) by the loop once the ranks are started."""
    store = LoopbackStore(timeout_s)
    return store, store.port


def named_port_store(host: str, port: int):
    """The store on the port the user named (--master-port on one machine), held for the launch
    as torch's rendezvous held it: a second launch on that port fails at once, not midway."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=60))


@dataclass
class Attempt:
    """What every rank of one attempt shares."""
    run_id: str
    nproc: int
    number: int  # 0, then 1 for the first restart (TORCHELASTIC_RESTART_COUNT)
    max_restarts: int
    master_port: int
    visible: str | None = None  # the ranks' CUDA_VISIBLE_DEVICES, where not the launcher's
    # several nodes (node_rendezvous): where the ranks meet, this node's place, every node's ranks
    master_addr: str = LOOPBACK
    group_rank: int = 0
    group_world_size: int = 1
    first_rank: int = 0  # the global rank of local rank 0
    world_size: int | None = None  # None: nproc (one node)


def rank_environment(local_rank: int, attempt: Attempt) -> dict[str, str]:
    """The variables torch's LocalElasticAgent sets for one worker (one role: its role rank is its
    global rank), added to the launcher's environment; TORCHELASTIC_ERROR_FILE comes with the log
    folders (rank_logs). One node: global rank = local rank."""
    rank, world = str(attempt.first_rank + local_rank), str(attempt.world_size or attempt.nproc)
    env = {
        "RANK": rank, "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(attempt.group_rank),
        "ROLE_RANK": rank, "ROLE_NAME": ROLE, "LOCAL_WORLD_SIZE": str(attempt.nproc),
        "WORLD_SIZE": world, "GROUP_WORLD_SIZE": str(attempt.group_world_size),
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": attempt.master_addr, "MASTER_PORT": str(attempt.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt.number),
        "TORCHELASTIC_MAX_RESTARTS": str(attempt.max_restarts),
        "TORCHELASTIC_RUN_ID": attempt.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(True),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # torchrun's launch_agent sets it for its own handlers; a worker inherits it
        "TORCHELASTIC_SIGNALS_TO_HANDLE": STOP_SIGNALS,
    }
    if attempt.visible is not None:  # a lost GPU dropped (lost_devices)
        env["CUDA_VISIBLE_DEVICES"] = attempt.visible
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def rank_command(cmd: list[str], local_rank: int, python: bool) -> list[str]:
    """`cmd` as torchrun runs it for one rank: with this Python unbuffered (`python -u script`,
    `-m module`: cmd starts with "-m") unless python=False; torchrun's ${local_rank} macro
    replaced."""
    if python:
        cmd = [os.getenv("PYTHON_EXEC", sys.executable), "-u", *cmd]
    return [a.replace("${local_rank}", str(local_rank)) for a in cmd]
