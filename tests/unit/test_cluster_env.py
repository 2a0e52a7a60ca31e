"""Kubeflow Trainer's and SkyPilot's launch variables read as SLURM's are: `multigpu train ...` as
a pod's or a task's command runs across its nodes with no launch flags; node 0's DNS name waited
for, then one line."""
from __future__ import annotations

import argparse
import os
import time

import pytest

from multigpu.core.errors import UsageError
from multigpu.launcher import cluster_env, launch
from multigpu.launcher.ports import plan_rendezvous

KUBEFLOW = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
            "PET_MASTER_ADDR": "localhost", "PET_MASTER_PORT": "23456"}
SKYPILOT = {"SKYPILOT_NODE_RANK": "2", "SKYPILOT_NODE_IPS": "10.0.0.7\n10.0.0.8\n10.0.0.9\n",
            "SKYPILOT_NUM_NODES": "3", "SKYPILOT_NUM_GPUS_PER_NODE": "8", "SKYPILOT_TASK_ID": "t-1"}


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_launch_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("SLURM_", "PET_", "SKYPILOT_")):
            monkeypatch.delenv(k)
    return monkeypatch


def test_kubeflow_s_variables_give_the_launch_of_several_nodes(clean_env):
    for k, v in KUBEFLOW.items():
        clean_env.setenv(k, v)
    opts = launch.options_from_args(parse())
    assert (opts.nnodes, opts.node_rank, opts.master_addr, opts.master_port) == ("2", 1, "localhost", 23456)
    assert plan_rendezvous(opts).endpoint == "localhost:23456"
    assert launch.options_from_args(parse("--nnodes", "1")).nnodes == "1"  # flags win
    assert launch.options_from_args(parse("--node-rank", "0")).node_rank == 0
    clean_env.setenv("PET_NNODES", "1")  # one pod: nothing to read
    assert launch.options_from_args(parse()).nnodes == "1"


def test_skypilot_s_variables_give_the_launch_of_several_nodes(clean_env):
    for k, v in SKYPILOT.items():
        clean_env.setenv(k, v)
    found = cluster_env.cluster_launch_defaults()
    assert (found["nnodes"], found["node_rank"], found["master_addr"], found["rdzv_id"]) == \
        ("3", 2, "10.0.0.7", "skypilot-t-1")
    clean_env.setenv("SKYPILOT_NODE_IPS", "10.0.0.7")
    with pytest.raises(UsageError) as caught:
        launch.options_from_args(parse())
    assert str(caught.value) == ("SKYPILOT_NODE_IPS names 1 node(s) and SKYPILOT_NUM_NODES is 3: "
                                 "give the launch flags (--nnodes, --node-rank, --master-addr)")
    assert cluster_env.skypilot_defaults({**SKYPILOT, "SKYPILOT_NUM_NODES": "1"}) == {}


def test_a_master_name_that_never_resolves_is_waited_for_said_once_then_one_line(clean_env):
    said = []
    began = time.monotonic()
    with pytest.raises(UsageError) as caught:
        cluster_env.wait_for_master("node-0.no-such-pod.invalid", "PET_MASTER_ADDR", 1.5, said.append)
    assert 1.4 < time.monotonic() - began < 10
    assert said == ["multigpu: waiting for PET_MASTER_ADDR node-0.no-such-pod.invalid to resolve "
                    "(node 0 may still be starting; at most 1.5 s, --start-timeout)"]
    assert str(caught.value) == (
        "PET_MASTER_ADDR node-0.no-such-pod.invalid did not resolve in 1.5 s (node 0's pod or "
        "machine not up, or the name is wrong): check that it is running, or give a longer "
        "--start-timeout")


def test_a_master_name_that_resolves_later_is_waited_for_and_the_launch_goes_on():
    said, answers = [], iter([False, False, True])

    def resolve(host, port):  # the pod's DNS record appears on the third look
        if not next(answers):
            import socket
            raise socket.gaierror("not yet")
    cluster_env.wait_for_master("trainer-node-0-0.job", "PET_MASTER_ADDR", 30, said.append, resolve)
    assert len(said) == 1 and said[0].startswith("multigpu: waiting for PET_MASTER_ADDR trainer-node-0-0.job")
