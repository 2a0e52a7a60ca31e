"""Where the nodes of a launch of several machines meet (launcher/node_rendezvous.py): two nodes
in threads of this process, on loopback, through torch's c10d rendezvous."""
from __future__ import annotations

import socket
import threading

from multigpu.launcher import node_rendezvous
from multigpu.launcher.launch_options import LaunchOptions
from multigpu.launcher.local_rendezvous import Attempt, rank_environment
from multigpu.launcher.ports import plan_rendezvous


def _nodes(port: int) -> list[node_rendezvous.NodeRendezvous]:
    """Node 0 (it hosts the rendezvous' store), then node 1."""
    made = []
    for rank in (0, 1):
        opts = LaunchOptions(nnodes="2", node_rank=rank, rdzv_endpoint=f"127.0.0.1:{port}",
                             start_timeout=30)
        made.append(node_rendezvous.NodeRendezvous(plan_rendezvous(opts), opts.nnodes))
    return made


def _free_port() -> int:
    with socket.socket() as s:  # test-only: a port for the two nodes to agree on
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_number_their_ranks_and_agree_on_the_attempt():
    nodes = _nodes(_free_port())
    asked = [Attempt("job", 2, 0, 3, 0), Attempt("job", 3, 1, 3, 0)]  # node 1 counted a restart
    got: dict[int, Attempt] = {}

    def meet(i):
        got[i] = nodes[i].next_attempt(asked[i])[1]
    threads = [threading.Thread(target=meet, args=(i,)) for i in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(got) == [0, 1]
        assert {a.number for a in got.values()} == {1}  # the highest count: in step
        assert {(a.world_size, a.group_world_size) for a in got.values()} == {(5, 2)}
        by_group = sorted(got.values(), key=lambda a: a.group_rank)
        assert [a.group_rank for a in by_group] == [0, 1]
        assert [a.first_rank for a in by_group] == [0, by_group[0].nproc]
        host = next(n for n in nodes if n.group_rank == 0)
        assert {(a.master_addr, a.master_port) for a in got.values()} == {("127.0.0.1", host.ranks_store.port)}
        assert [n.why_end() for n in nodes] == [None, None]
    finally:
        for n in reversed(nodes):
            n.shutdown()
    assert nodes[0].ranks_store is None and nodes[1].why_end() in (node_rendezvous.CLOSED, node_rendezvous.LOST)


def test_a_rank_of_a_second_node_gets_its_global_rank_and_the_node_s_place():
    attempt = Attempt("job", 2, 1, 3, 4567, master_addr="n01", group_rank=1, group_world_size=2,
                      first_rank=3, world_size=5)
    env = rank_environment(1, attempt)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                                "TORCHELASTIC_USE_AGENT_STORE")} == {
        "RANK": "4", "LOCAL_RANK": "1", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "4", "ROLE_WORLD_SIZE": "5", "MASTER_ADDR": "n01",
        "MASTER_PORT": "4567", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
