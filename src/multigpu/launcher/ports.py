"""The rendezvous: where its store lives (host, port, who hosts it), port checks, and its state.

We never pick a port by binding it, closing it and handing the number on: another job can take it
in between (trap 8, "Address already in use" when several jobs start at once). Single-node runs
let the rendezvous store bind port 0 instead, so the kernel picks, on 127.0.0.1 only: nothing
outside the machine can reach the job's store.
"""
from __future__ import annotations

import errno
import re
import socket
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from multigpu.core.errors import UsageError

if TYPE_CHECKING:
    from multigpu.launcher.launch_options import LaunchOptions

DEFAULT_PORT = 29500
LOOPBACK_ENDPOINT = "127.0.0.1:0"  # one machine: the store on loopback, its port picked by the kernel


def port_holder(port: int) -> str | None:
    """'pid 123 (python train.py)' for the process listening on `port`, where psutil can tell."""
    try:
        import psutil

        conns = psutil.net_connections(kind="inet")
    except Exception:  # psutil.AccessDenied on some systems
        return None
    for c in conns:
        if c.laddr and c.laddr.port == port and c.status == "LISTEN":
            if c.pid is None:
                return "a process of another user (its pid is not readable)"
            try:
                p = psutil.Process(c.pid)
                cmd = " ".join(" ".join(p.cmdline()).split()) or p.name()
                cmd = cmd if len(cmd) <= 60 else cmd[:57] + "..."
            except Exception:
                cmd = "?"
            return f"pid {c.pid} ({cmd})"
    return None


def free_port() -> int:
    """A port the kernel says is free now, for a command that must be given a number before it
    starts (a sweep's {port}). The exception to the rule above, with its race: our own launches
    never use it."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """True when something listens on `port` (any address).

    A probe bind, never used to choose a port, only to explain a failure before it happens.
    """
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # ignore TIME_WAIT leftovers
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
        finally:
            s.close()
    return False


def check_named_port(port: int, flag: str) -> None:
    """Raise UsageError when the port the user named (`flag`) is already taken on this machine."""
    if not port_in_use(port):
        return
    holder = port_holder(port)
    who = f"held by {holder}" if holder else "held by another process"
    raise UsageError(f"{flag} {port}: the port is already in use ({who}); leave out {flag} on a "
                     "single machine to let multigpu pick a free port, or name another port")


def parse_endpoint(endpoint: str, default_port: int) -> tuple[str, int]:
    """'host:port', 'host' or '[v6::addr]:port' -> (host, port)."""
    e = endpoint.strip()
    host, sep, port = e.rpartition(":")
    if e.startswith("[") and "]" in e:
        host, _, rest = e[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif not sep or ":" in host:  # no port, or a bare IPv6 address
        host, port = e, ""
    if not host:
        raise UsageError(f"--rdzv-endpoint {endpoint!r} has no host; use HOST:PORT, "
                         "e.g. --rdzv-endpoint node01:29500")
    if port and not port.isdigit():
        raise UsageError(f"--rdzv-endpoint {endpoint!r}: port {port!r} is not a number; use "
                         "HOST:PORT, e.g. --rdzv-endpoint node01:29500")
    return host, int(port) if port else default_port


# --------------------------------------------------------------------------- the rendezvous plan

def parse_nnodes(nnodes: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(nnodes))
    lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or not 0 < lo <= hi:
        raise UsageError(f"--nnodes {nnodes}: use a number of machines (--nnodes 2) or a range "
                         "MIN:MAX with 1 <= MIN <= MAX (--nnodes 2:4)")
    return lo, hi


@dataclass
class Rendezvous:
    endpoint: str  # host:port given to torchrun; port 0 = the kernel picks
    run_id: str
    conf: dict[str, str]
    named_port: tuple[int, str] | None  # (port, flag) to check here, when this node hosts it


def plan_rendezvous(opts: LaunchOptions) -> Rendezvous:
    """Where the c10d rendezvous store lives and who hosts it (see the module docstring)."""
    _, max_nodes = parse_nnodes(opts.nnodes)
    timeout = max(1, round(opts.start_timeout))
    # join_timeout: the whole rendezvous; read_timeout: how long a node waits for node 0's store.
    conf = {"join_timeout": str(timeout), "read_timeout": str(max(timeout, 10))}
    if opts.rdzv_endpoint and (opts.master_addr or opts.master_port):
        raise UsageError("--rdzv-endpoint HOST:PORT replaces --master-addr/--master-port; "
                         "pass one or the other")
    if opts.rdzv_endpoint:
        host, port = parse_endpoint(opts.rdzv_endpoint, DEFAULT_PORT)
        flag = "--rdzv-endpoint port"
    else:
        host, port = opts.master_addr, opts.master_port
        flag = "--master-port"

    if max_nodes == 1:
        if host is None and port is None:
            return Rendezvous(LOOPBACK_ENDPOINT, opts.rdzv_id or f"multigpu-{uuid.uuid4().hex[:8]}",
                              conf | {"is_host": "1"}, None)
        host, port = host or "localhost", port or DEFAULT_PORT
        return Rendezvous(_join(host, port), opts.rdzv_id or f"multigpu-{uuid.uuid4().hex[:8]}",
                          conf | {"is_host": "1"}, (port, flag))

    if not host:
        raise UsageError(f"--nnodes {opts.nnodes} needs the address of node 0 on every node: add "
                         "--master-addr HOST --master-port PORT (or --rdzv-endpoint HOST:PORT)")
    port = port or DEFAULT_PORT
    named = None
    if opts.node_rank is not None:
        if not 0 <= opts.node_rank < max_nodes:
            raise UsageError(f"--node-rank {opts.node_rank} is outside 0..{max_nodes - 1} for "
                             f"--nnodes {opts.nnodes}; give each machine its own rank")
        # Node 0 hosts the store; the others only connect. Said explicitly, because guessing it
        # from the host name fails behind NAT or with several "nodes" on one machine.
        conf["is_host"] = "1" if opts.node_rank == 0 else "0"
        named = (port, flag) if opts.node_rank == 0 else None
    return Rendezvous(_join(host, port), opts.rdzv_id or "multigpu", conf, named)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --------------------------------------------------------------------------- rendezvous watching
# torch's c10d rendezvous, its backend seen through a subclass so that we can see its state: when
# it times out we can say how many nodes had joined. Same store, same handler, same protocol; the
# subclass only remembers what passed through its public get_state/set_state. One observer per
# process (a launch makes one handler: node_rendezvous).

class _Observer:
    def reset(self) -> None:
        self.nodes: set[str] = set()

    def saw(self, state_bytes: bytes | None) -> None:
        import pickle

        try:  # the state written by torchrun's own DynamicRendezvousHandler
            state = pickle.loads(state_bytes) if state_bytes else None
            self.nodes |= {str(n) for n in getattr(state, "participants", {})}
            self.nodes |= {str(n) for n in getattr(state, "wait_list", ())}
        except Exception:  # a torch version with another layout: we just know less
            pass

    def joined(self) -> list[str]:
        return sorted(self.nodes)


OBSERVER = _Observer()
OBSERVER.reset()
BACKEND_NAME = "multigpu-c10d"


def create_rendezvous_handler(params):
    """torch's c10d rendezvous handler for `params` (RendezvousParameters), observed."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class ObservedC10dBackend(c10d.C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return BACKEND_NAME

        def get_state(self):
            result = super().get_state()
            OBSERVER.saw(result[0] if result else None)
            return result

        def set_state(self, state, token=None):
            result = super().set_state(state, token)
            OBSERVER.saw(result[0] if result else None)
            return result

    _, store = c10d.create_backend(params)  # binds (or connects to) node 0's TCP store
    return create_handler(store, ObservedC10dBackend(store, params.run_id), params)
