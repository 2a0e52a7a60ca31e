"""Where the nodes of a launch of several machines meet, each attempt (local_loop, for
--nnodes > 1): torch's c10d rendezvous through its public handler API, and what each node's ranks
are told.

Per attempt every node's launcher calls the handler's `next_rendezvous()` (ports.py makes the
handler: node 0 hosts its store, --start-timeout bounds the join). Its RendezvousInfo gives the
round's store, this node's rank among the nodes (torch numbers them when the round completes)
and their number. Through that store (public get/set/check only) each node says how many ranks
it starts and how many restarts it has counted; a node's global ranks start at the sum of the
lower nodes', WORLD_SIZE is the total, and the attempt's number (TORCHELASTIC_RESTART_COUNT, its
log folder) the highest count, so a node that restarts only because another one failed is in
step with it. Node rank 0's launcher then holds a fresh TCPStore for the ranks' process group,
its port picked by the kernel as it binds (ports.py: never pick-then-bind), and says where it is;
every rank joins it as a client (TORCHELASTIC_USE_AGENT_STORE=True, torchrun's default: the
agent's store shared), a new one each attempt so that no key of a dead group is read again. It
is held until the next round completes (every node's ranks of this attempt ended by then) or the
launch ends: closed earlier, the ranks of a node still waiting in it print torch's C++ dump of
the lost connection on their way out.

While the ranks run, `why_end()` says when the attempt must end for the nodes' sake: a node waits
in the rendezvous (it restarts after a failure, or joins: torchrun's agent looks at the same
`num_nodes_waiting()` each monitor interval), or the rendezvous was closed (a node ended the run).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import time
from dataclasses import replace

from multigpu.launcher import ports
from multigpu.launcher.local_rendezvous import Attempt
from multigpu.launcher.ports import Rendezvous

REJOIN, CLOSED, LOST = "rejoin", "closed", "lost"  # why_end()'s answers
WHY = {REJOIN: "a node is waiting in the rendezvous (its ranks failed and restart, or it joins): "
               "every node's ranks start again",
       CLOSED: "another node ended the run (its ranks failed with no restart left, or it was "
               "stopped)",
       LOST: "the rendezvous can no longer be reached (node 0's launcher ended?)"}
EXIT_BARRIER_WAIT = 300.0  # s a node that is done waits for the others (torchrun's exit barrier)
LEAVE_WAIT = 40.0  # s node 0 waits for the others to leave: their ranks get 30 s to stop
KEY = "multigpu/"  # our keys in the round's store, beside torch's own
# The handler's own per-round MASTER_ADDR/MASTER_PORT (unused here), made afresh each round: with
# torch's store of the nodes shared (its default), a node numbered 0 again in a later round does
# not say them, and a node that joins then waits for them until the read timeout (torch 2.13,
# seen with --nnodes 1:2 when the second node came).
HANDLER_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class NodeRendezvous:
    """This node's side of the rendezvous of one launch: `next_attempt` each attempt,
    `why_end` while the ranks run, `exit_barrier` once they are done, `shutdown` at the end."""

    def __init__(self, rdzv: Rendezvous, nnodes: str):
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        lo, hi = ports.parse_nnodes(nnodes)
        self.rdzv = rdzv
        params = RendezvousParameters(backend="c10d", endpoint=rdzv.endpoint,
                                      run_id=rdzv.run_id, min_nodes=lo, max_nodes=hi, **rdzv.conf)
        ports.OBSERVER.reset()
        self.handler = ports.create_rendezvous_handler(params)
        self.timeout = float(rdzv.conf.get("join_timeout", EXIT_BARRIER_WAIT))
        self.store, self.group_rank, self.nodes = None, 0, 1
        self.ranks_store = None  # node rank 0: the ranks' store of the attempt (held here)

    def next_attempt(self, attempt: Attempt):
        """(None: the ranks' store is held here; `attempt` as the round completed it: its number,
        the global ranks, where the ranks meet)."""
        info = self.handler.next_rendezvous()
        self.ranks_store = None  # every node's ranks of the last attempt have ended
        self.store, self.group_rank, self.nodes = info.store, info.rank, info.world_size
        self.store.set(f"{KEY}node/{self.group_rank}",
                       json.dumps({"nproc": attempt.nproc, "restarts": attempt.number}))
        said = [json.loads(self.store.get(f"{KEY}node/{r}")) for r in range(self.nodes)]
        if self.group_rank == 0:
            self.ranks_store = _ranks_store(self._address())
            self.store.set(f"{KEY}master", json.dumps([self._address(), self.ranks_store.port]))
        addr, port = json.loads(self.store.get(f"{KEY}master"))
        first = sum(s["nproc"] for s in said[:self.group_rank])
        return None, replace(attempt, number=max(s["restarts"] for s in said),
                                    master_addr=addr, master_port=port,
                                    group_rank=self.group_rank, group_world_size=self.nodes,
                                    first_rank=first, world_size=sum(s["nproc"] for s in said))

    def _address(self) -> str:
        """Where the other nodes reach this one: the rendezvous' host where this node hosts it
        (every node reaches it there), else this machine's name, as torch's agent says it."""
        if self.rdzv.conf.get("is_host") == "1":
            return ports.parse_endpoint(self.rdzv.endpoint, ports.DEFAULT_PORT)[0]
        return socket.getfqdn()

    def why_end(self) -> str | None:
        """REJOIN, CLOSED or LOST when this attempt must end for the nodes' sake, else None
        (torch caches the rendezvous' state for a second: cheap to ask each monitor interval)."""
        try:
            if self.handler.num_nodes_waiting() > 0:
                return REJOIN
            return CLOSED if self.handler.is_closed() else None
        except Exception:  # node 0's store is gone
            return LOST

    def exit_barrier(self, asked_to_stop) -> None:
        """Until every node's ranks are done (each node's stores stay up for the others' ranks),
        a node waits in the rendezvous (it would restart, but this run is done here), a stop is
        asked for (`asked_to_stop()`), or EXIT_BARRIER_WAIT s."""
        keys = [f"{KEY}done/{r}" for r in range(self.nodes)]
        deadline = time.monotonic() + EXIT_BARRIER_WAIT
        with contextlib.suppress(Exception):  # a node gone: nothing to wait for
            self.store.set(keys[self.group_rank], "1")
            while not self.store.check(keys) and time.monotonic() < deadline:
                if asked_to_stop() or self.why_end() is not None:
                    return
                time.sleep(0.1)

    def shutdown(self) -> None:
        """The rendezvous closed for every node (the run ends here; torchrun's agent does it at
        its end too), then this node's leaving said; a store already gone is no error of the
        run's. Node 0, whose launcher holds the rendezvous' store, waits for the others to have
        left (at most LEAVE_WAIT s, a Ctrl-C ends it): gone earlier, it leaves them reading a
        store that is no more (torch's C++ dumps of the lost connection, a rendezvous lost)."""
        with contextlib.suppress(Exception):
            self.handler.shutdown()
        self.ranks_store = None
        if self.store is None:
            return
        key, deadline = f"{KEY}left", time.monotonic() + LEAVE_WAIT
        try:
            left = self.store.add(key, 1)
            while self.rdzv.conf.get("is_host") == "1" and left < self.nodes \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
                left = self.store.add(key, 0)
        except (Exception, KeyboardInterrupt):
            pass


def _ranks_store(host: str):
    """A fresh TCPStore for the ranks' process group, on every interface, its port picked by the
    kernel as it binds."""
    from torch.distributed import TCPStore

    return TCPStore(host, 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=300))


@contextlib.contextmanager
def quiet_torchelastic():
    """torch's rendezvous logs its own lines (joins, heartbeats, a failed shutdown); the launcher
    says what matters in its own. MULTIGPU_DEBUG keeps them."""
    # imported first: each module sets its logger's level as it is imported
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous  # noqa: F401

    names = ["torch.distributed.elastic"] + [n for n in logging.root.manager.loggerDict
                                              if n.startswith("torch.distributed.elastic.")]
    saved = {n: logging.getLogger(n).level for n in names}
    if not os.environ.get("MULTIGPU_DEBUG"):
        for n in names:  # torch's elastic modules set levels on their own loggers
            logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
