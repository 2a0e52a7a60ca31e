"""The launcher without launching: flags, rendezvous plans, SLURM, messages, run helpers."""
from __future__ import annotations

import argparse
import os
import socket

import pytest

from multigpu.launcher import launch, launch_failures, ports, sysinfo
from multigpu.launcher import scripts
from multigpu.launcher.devices import DevicePlan
from multigpu.core.errors import UsageError
from multigpu.launcher.launch import LaunchOptions, plan_rendezvous

CPU2 = DevicePlan("cpu", (), 2)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_launch_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture
def no_slurm(monkeypatch):
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)


# ------------------------------------------------------------------------------- flags and options

def test_launch_flags_are_pinned():
    p = argparse.ArgumentParser()
    launch.add_launch_arguments(p)
    flags = {s for a in p._actions for s in a.option_strings} - {"-h", "--help"}
    assert flags == {"--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-endpoint",
                     "--rdzv-id", "--start-timeout", "--max-restarts", "--tee", "--log-dir",
                     "--hang-timeout", "--min-devices", "--device-health"}


def test_options_defaults(no_slurm):
    assert launch.options_from_args(parse()) == LaunchOptions()


def test_options_from_flags(no_slurm):
    opts = launch.options_from_args(parse("--nnodes", "2", "--node-rank", "1", "--master-addr",
                                          "n01", "--master-port", "1234", "--tee",
                                          "--start-timeout", "10"))
    assert (opts.nnodes, opts.node_rank, opts.master_addr, opts.master_port, opts.tee,
            opts.start_timeout) == ("2", 1, "n01", 1234, True, 10.0)


def test_in_worker(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not launch.in_worker()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert launch.in_worker()


# ------------------------------------------------------------------------------- rendezvous plans

def test_single_node_plan_is_a_fresh_store_on_loopback():
    rdzv = plan_rendezvous(LaunchOptions(start_timeout=7.4))
    assert rdzv.endpoint == ports.LOOPBACK_ENDPOINT and rdzv.named_port is None
    assert rdzv.conf["join_timeout"] == "7" and rdzv.conf["is_host"] == "1"


def test_single_node_named_port():
    rdzv = plan_rendezvous(LaunchOptions(master_port=29511))
    assert rdzv.endpoint == "localhost:29511" and rdzv.named_port == (29511, "--master-port")


def test_multi_node_plans():
    rdzv = plan_rendezvous(LaunchOptions(nnodes="2", node_rank=0, master_addr="n01"))
    assert rdzv.endpoint == "n01:29500" and rdzv.conf["is_host"] == "1"
    assert rdzv.named_port == (29500, "--master-port") and rdzv.run_id == "multigpu"
    rdzv = plan_rendezvous(LaunchOptions(nnodes="2:4", node_rank=3, rdzv_endpoint="n01:1234"))
    assert rdzv.endpoint == "n01:1234" and rdzv.conf["is_host"] == "0" and rdzv.named_port is None
    rdzv = plan_rendezvous(LaunchOptions(nnodes="2", master_addr="n01"))  # no rank: torch guesses
    assert "is_host" not in rdzv.conf


@pytest.mark.parametrize("opts, match", [
    (LaunchOptions(nnodes="2"), r"--nnodes 2 needs the address of node 0.*--master-addr"),
    (LaunchOptions(nnodes="2", node_rank=2, master_addr="a"), r"--node-rank 2 is outside 0..1"),
    (LaunchOptions(nnodes="0"), r"--nnodes 0: use a number"),
    (LaunchOptions(nnodes="4:2"), r"MIN:MAX with 1 <= MIN <= MAX"),
    (LaunchOptions(nnodes="two"), r"--nnodes two"),
    (LaunchOptions(rdzv_endpoint="a:1", master_addr="b"), r"pass one or the other"),
    (LaunchOptions(nnodes="2", rdzv_endpoint="a:xx"), r"port 'xx' is not a number"),
])
def test_rendezvous_mistakes(opts, match):
    with pytest.raises(UsageError, match=match):
        plan_rendezvous(opts)


def test_parse_endpoint():
    assert ports.parse_endpoint("n01:1234", 1) == ("n01", 1234)
    assert ports.parse_endpoint("n01", 29500) == ("n01", 29500)
    assert ports.parse_endpoint("[::1]:80", 1) == ("::1", 80)


def test_child_environment_imposes_no_site_rule_and_restores(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's choice passes through
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    before = dict(os.environ)
    plan = DevicePlan("cuda", (1,), 1, ("H200",), ("3",), "2,3")
    with launch.child_environment(plan, LaunchOptions(tee=True)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
        assert os.environ["NCCL_NVLS_ENABLE"] == "1"
        # NVLink SHARP / multicast stay torch's and NCCL's choice on the user's machine
        assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in os.environ
        assert "NVSHMEM_DISABLE_NVLS" not in os.environ
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert "rank" in os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"]
    assert dict(os.environ) == before


# ------------------------------------------------------------------------------- ports

def test_named_port_taken_names_the_holder():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        with pytest.raises(UsageError) as e:
            ports.check_named_port(port, "--master-port")
        msg = str(e.value)
        assert f"--master-port {port}: the port is already in use" in msg
        assert f"pid {os.getpid()}" in msg and "leave out --master-port" in msg
    finally:
        s.close()
    ports.check_named_port(port, "--master-port")  # free again: no error


# ------------------------------------------------------------------------------- SLURM

@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("gpu7", ["gpu7"]),
    ("a[1,3-4]", ["a1", "a3", "a4"]),
    ("rack[1-2]-n[9-10]", ["rack1-n9", "rack1-n10", "rack2-n9", "rack2-n10"]),
    ("x[008-010]y", ["x008y", "x009y", "x010y"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert sysinfo.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node[a-b]", ""])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(ValueError):
        sysinfo.expand_nodelist(bad)


SLURM = {"SLURM_JOB_ID": "777", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "node[07-09]", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3"}


def test_slurm_defaults():
    d = sysinfo.slurm_launch_defaults(SLURM)
    assert (d["nnodes"], d["node_rank"], d["master_addr"], d["rdzv_id"]) == \
        ("3", 2, "node07", "slurm-777.0")
    assert sysinfo.slurm_launch_defaults({**SLURM, "SLURM_NNODES": "1"}) == {}
    assert sysinfo.slurm_launch_defaults({}) == {}


def test_options_read_slurm(monkeypatch, no_slurm):
    for k, v in SLURM.items():
        monkeypatch.setenv(k, v)
    opts = launch.options_from_args(parse())
    assert (opts.nnodes, opts.node_rank, opts.master_addr, opts.rdzv_id) == \
        ("3", 2, "node07", "slurm-777.0")
    assert plan_rendezvous(opts).endpoint == "node07:29500"
    opts = launch.options_from_args(parse("--master-port", "1234", "--rdzv-id", "mine"))
    assert plan_rendezvous(opts).endpoint == "node07:1234" and opts.rdzv_id == "mine"
    assert launch.options_from_args(parse("--nnodes", "1")).nnodes == "1"  # flags win
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "12")
    with pytest.raises(UsageError, match="srun --ntasks-per-node=1"):
        launch.options_from_args(parse())


# ------------------------------------------------------------------------------- messages

def test_rendezvous_timeout_message():
    opts = LaunchOptions(nnodes="2", node_rank=0, master_addr="n01", start_timeout=10)
    msg = launch_failures.rendezvous_timeout_message(opts, plan_rendezvous(opts), ["n01_123_0"])
    assert "did not complete within --start-timeout 10 s: 1 of 2 nodes joined (n01)" in msg
    assert "--node-rank" in msg and "n01:29500" in msg and "\n" not in msg


def test_rendezvous_port_in_use_message():
    opts = LaunchOptions(master_port=29999)
    exc = RuntimeError("The server socket has failed to listen on any local network address. "
                       "port: 29999, useIpv6: false, code: -98, name: EADDRINUSE")
    msg = launch_failures.rendezvous_failed_message(exc, opts, plan_rendezvous(opts))
    assert "port 29999" in msg and "already in use" in msg and "--master-port" in msg


def test_observer_counts_joined_nodes():
    import pickle
    from types import SimpleNamespace

    obs = ports._Observer()
    obs.reset()
    obs.saw(pickle.dumps(SimpleNamespace(participants={"a_1_0": 0}, wait_list=set())))
    obs.saw(b"not a pickle")
    obs.saw(None)
    assert obs.joined() == ["a_1_0"]


def test_failure_report_blames_the_crashing_rank(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    for rank, text in ((1, "Traceback (most recent call last):\n  x\nValueError: boom-rank-1"),
                       (2, "Traceback (most recent call last):\n  y\n"
                           "RuntimeError: [gloo] Connection closed by peer")):
        d = tmp_path / "run_abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text("noise\n" + text + "\n")
    none = str(tmp_path / "missing.json")
    failures = {0: ProcessFailure(0, 100, -15, none), 2: ProcessFailure(2, 102, 1, none),
                1: ProcessFailure(1, 101, 1, none)}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path))
    err = capsys.readouterr().err
    assert code == 1
    assert "rank 1 failed first (exit code 1" in err and "ValueError: boom-rank-1" in err
    assert "also stopped: rank 0 (signal SIGTERM), rank 2 (exit 1)" in err
    assert "noise" not in err  # the traceback only


@pytest.mark.parametrize("rank_0_ended, rank_0_said, one_line", [
    (-15, "", True), (1, "RuntimeError: [gloo] Connection closed by peer", True),
    (-9, "", False), (1, "ValueError: boom", False)])
def test_bad_input_is_one_line_when_the_other_ranks_only_echo_it(
        tmp_path, capsys, rank_0_ended, rank_0_said, one_line):
    """Rank 1 found bad input (exit 2, one line); rank 0 was stopped by the agent's SIGTERM or
    lost its peer: one line. Killed otherwise (-9) or failing on its own: the full report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import json

    d = tmp_path / "run_abc" / "attempt_0" / "1"
    d.mkdir(parents=True)
    (d / "stderr.log").write_text("multigpu: error: column 'b' holds 'x'\n")
    error_file = tmp_path / "error0.json"  # rank 0's output is on the console: its error file
    if rank_0_said:
        error_file.write_text(json.dumps({"message": rank_0_said, "timestamp": 1}))
    failures = {1: ProcessFailure(1, 101, 2, str(tmp_path / "missing.json")),
                0: ProcessFailure(0, 100, rank_0_ended, str(error_file))}
    cleaned = []
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path),
                                               on_usage_error=lambda: cleaned.append(True))
    err = capsys.readouterr().err
    if one_line:
        assert (code, err, cleaned) == (2, "multigpu: error: column 'b' holds 'x'\n", [True])
    else:
        assert cleaned == [] and "failed first" in err and f"logs of every rank: {tmp_path}" in err


def test_an_earlier_launch_s_tee_logs_in_the_same_folder_do_not_hide_this_launch_s_error(tmp_path, capsys):
    """A run resumed in its folder: the first launch used --tee (rank 0's output logged too);
    this one did not, and rank 1 met bad input while rank 0 was stopped by the agent. Rank 1's
    line is not on the console: the report must print it."""
    import os
    import time

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    earlier = tmp_path / "multigpu-1_aa" / "attempt_0"
    for rank in (0, 1):
        (earlier / str(rank)).mkdir(parents=True)
        (earlier / str(rank) / "stderr.log").write_text("epoch 1 ...\n")
    hour_ago = time.time() - 3600
    os.utime(tmp_path / "multigpu-1_aa", (hour_ago, hour_ago))
    began = time.time()
    now = tmp_path / "multigpu-2_bb" / "attempt_0"
    (now / "1").mkdir(parents=True)
    (now / "1" / "stderr.log").write_text("multigpu: error: cannot read image 'x.png'\n")
    failures = {1: ProcessFailure(1, 101, 2, str(now / "1" / "error.json")),
                0: ProcessFailure(0, 100, -15, str(now / "0" / "error.json"))}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path),
                                               on_usage_error=lambda: None, since=began)
    assert (code, capsys.readouterr().err) == (2, "multigpu: error: cannot read image 'x.png'\n")
    # Rank 1's error file (multigpu's workers write one) names this launch's folder: no clock needed.
    (now / "1" / "error.json").write_text('{"message": "multigpu: error: cannot read image \'x.png\'"}')
    os.utime(tmp_path / "multigpu-2_bb", (hour_ago, hour_ago))
    failures = {1: ProcessFailure(1, 101, 2, str(now / "1" / "error.json")),
                0: ProcessFailure(0, 100, -15, str(now / "0" / "error.json"))}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path),
                                               on_usage_error=lambda: None)
    assert (code, capsys.readouterr().err) == (2, "multigpu: error: cannot read image 'x.png'\n")


def test_a_usage_error_naming_a_timeout_is_one_line_and_said_once_with_tee(tmp_path, capsys):
    """Every rank said the same line (which names a timeout: not an echo for that); with --tee
    every rank's output, rank 0's too, is on the console already: nothing more is printed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    line = "multigpu: error: saving a checkpoint to /nfs/run failed: Connection timed out (x)"
    for rank in (0, 1):
        d = tmp_path / "run_abc" / "attempt_0" / str(rank)
        d.mkdir(parents=True)
        (d / "stderr.log").write_text(line + "\n")
    none = str(tmp_path / "missing.json")
    failures = {0: ProcessFailure(0, 100, 2, none), 1: ProcessFailure(1, 101, 2, none)}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path),
                                               on_usage_error=lambda: None)
    assert (code, capsys.readouterr().err) == (2, "")
    failures = {1: ProcessFailure(1, 101, 2, none), 0: ProcessFailure(0, 100, -15, none)}
    (tmp_path / "run_abc" / "attempt_0" / "0" / "stderr.log").write_text("[warning]\n")
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path),
                                               on_usage_error=lambda: None)
    assert (code, capsys.readouterr().err) == (2, "")  # rank 1's line is on the console (tee)


@pytest.mark.parametrize("ours", [True, False])
def test_bad_input_said_on_the_console_alone_is_one_line_only_from_multigpu_s_own_workers(
        tmp_path, capsys, ours):
    """Local rank 0 writes to the console: its line cannot be read back. multigpu's own workers
    exit 2 only after saying one; a user's script may exit 2 for any reason: the full report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    none = str(tmp_path / "missing.json")
    failures = {0: ProcessFailure(0, 100, 2, none), 1: ProcessFailure(1, 101, -15, none)}
    cleaned = []
    code = launch_failures.report_child_failed(
        ChildFailedError("x", failures), str(tmp_path),
        on_usage_error=(lambda: cleaned.append(True)) if ours else None)
    err = capsys.readouterr().err
    if ours:
        assert (code, err, cleaned) == (2, "", [True])
    else:
        assert code == 2 and "rank 0 failed first (exit code 2" in err and "its traceback is in its output above" in err


def test_the_console_rank_s_error_file_shows_its_failure_was_an_echo(tmp_path, capsys):
    """Local rank 0 (on the console, no log) lost its peer and exited 1; its error file, which
    multigpu's workers leave, says so: rank 1's bad input is the one line, and the report of a
    real crash points at the console instead of printing rank 0's traceback twice."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    d = tmp_path / "run_abc" / "attempt_0" / "1"
    d.mkdir(parents=True)
    (d / "stderr.log").write_text("multigpu: error: cannot read image 'x.png'\n")
    echo = tmp_path / "error0.json"
    echo.write_text(json.dumps({"message": "Traceback (most recent call last):\n  x\nRuntimeError: "
                                "[gloo] Connection closed by peer", "timestamp": 1}))
    failures = {0: ProcessFailure(0, 100, 1, str(echo)),
                1: ProcessFailure(1, 101, 2, str(tmp_path / "missing.json"))}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path),
                                               on_usage_error=lambda: None)
    assert (code, capsys.readouterr().err) == (2, "multigpu: error: cannot read image 'x.png'\n")
    crash = tmp_path / "error1.json"
    crash.write_text(json.dumps({"message": "Traceback (most recent call last):\nValueError: boom",
                                 "timestamp": 1}))
    failures = {0: ProcessFailure(0, 100, 1, str(crash)), 1: ProcessFailure(1, 101, -15, str(echo))}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path))
    err = capsys.readouterr().err
    assert code == 1 and "rank 0 failed first (exit code 1" in err, err
    assert "its traceback is in its output above" in err and "boom" not in err


@pytest.mark.parametrize("ours", [True, False])
def test_an_echo_kept_off_the_console_is_shown_when_its_rank_is_to_blame(tmp_path, capsys, monkeypatch, ours):
    """multigpu's workers leave a communication error (an echo) to the report instead of the
    console: when that rank is the one blamed, the report shows its traceback; a user's script
    (`multigpu run`, not ours) printed its own, and with --debug ours did too."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    monkeypatch.delenv("MULTIGPU_DEBUG", raising=False)
    echo = tmp_path / "error0.json"
    echo.write_text(json.dumps({"message": "Traceback (most recent call last):\n  File x\n"
                                "torch.distributed.DistBackendError: NCCL error: unhandled system error",
                                "timestamp": 1}))
    failures = {0: ProcessFailure(0, 100, 1, str(echo)), 1: ProcessFailure(1, 101, -15, str(tmp_path / "no.json"))}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path),
                                               on_usage_error=(lambda: None) if ours else None)
    err = capsys.readouterr().err
    assert code == 1 and "rank 0 failed first (exit code 1" in err, err
    if ours:
        assert "---- rank 0 traceback ----" in err and "NCCL error: unhandled system error" in err, err
        monkeypatch.setenv("MULTIGPU_DEBUG", "1")
        launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path), on_usage_error=lambda: None)
        err = capsys.readouterr().err
    assert "its traceback is in its output above" in err and "NCCL error" not in err, err


def test_a_restarted_attempt_says_which_restart_what_failed_and_where(tmp_path):
    """The attempt folder is this worker's own run's (from its error file's path: another launch
    or node in the same logs folder is not it); the error named is the first of its own."""
    import json

    run = tmp_path / "logs" / "multigpu-1_ab"
    for rank, message in (("0", "Traceback ...\nRuntimeError: [gloo] Connection closed by peer"),
                          ("1", "Traceback (most recent call last):\n  File x\nValueError: boom")):
        (run / "attempt_0" / rank).mkdir(parents=True)
        (run / "attempt_0" / rank / "error.json").write_text(json.dumps({"message": message, "timestamp": 1}))
    (tmp_path / "logs" / "multigpu-1_zz" / "attempt_0").mkdir(parents=True)  # another launch's, newer
    env = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "3",
           "TORCHELASTIC_ERROR_FILE": str(run / "attempt_1" / "0" / "error.json")}
    assert launch_failures.restart_note(env) == (
        "restart 1 of 3 (--max-restarts): the previous attempt failed (local rank 1: ValueError: "
        f"boom); the output and errors of this node's ranks in it: {run / 'attempt_0'}")
    (run / "attempt_0" / "1" / "error.json").unlink()  # killed by a signal: no error of its own
    assert launch_failures.restart_note(env) == (
        "restart 1 of 3 (--max-restarts): the previous attempt failed; the output and errors of "
        f"this node's ranks in it: {run / 'attempt_0'}")
    assert launch_failures.restart_note({**env, "TORCHELASTIC_ERROR_FILE": ""}) == (
        "restart 1 of 3 (--max-restarts): the previous attempt failed")
    assert launch_failures.restart_note({**env, "TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert launch_failures.restart_note({}) is None


@pytest.mark.parametrize("rank_1_ended, said", [
    (-15, "raised an error"), (1, "exited with code 1"), (-9, "was killed by SIGKILL")])
def test_the_restart_line_names_the_rank_that_failed_not_the_one_that_lost_it(tmp_path, rank_1_ended, said):
    """Rank 1 raised (or was killed); rank 0 lost it in a collective and exited first, in the
    same second (an error file's time is in whole seconds; a rank without one gets the time the
    agent saw it end, later): the agent saw rank 0 first. Rank 1 is the one to name."""
    import json
    import time

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    now = int(time.time())
    echo, crash = tmp_path / "error0.json", tmp_path / "error1.json"
    echo.write_text(json.dumps({"message": "Traceback (most recent call last):\n  x\nRuntimeError: "
                                "[gloo] Connection closed by peer", "timestamp": now}))
    if rank_1_ended != -9:
        crash.write_text(json.dumps({"message": "Traceback (most recent call last):\n  y\n"
                                     "ValueError: boom-rank-1", "timestamp": now}))
    failures = {0: ProcessFailure(0, 100, 1, str(echo)), 1: ProcessFailure(1, 101, rank_1_ended, str(crash))}
    assert launch_failures.restart_line(failures, 1, 2) == (
        f"rank 1 (pid 101) {said}; restarting all workers (restart 1 of 2)")


# ------------------------------------------------------------------------------- `run` helpers

@pytest.mark.parametrize("source, flag", [
    ("p.add_argument('--local_rank', type=int)", "underscore"),
    ('p.add_argument("--local-rank", "--local_rank", type=int)', "dash"),
    ("os.environ['LOCAL_RANK']", "none"),
])
def test_detect_local_rank_flag(source, flag):
    assert scripts.detect_local_rank_flag(source) == flag


def test_script_command(tmp_path):
    py = tmp_path / "train.py"
    py.write_bytes(b"#!/usr/bin/env python\r\nprint(1)\r\n")  # Python copes with CRLF
    assert scripts.script_command(py) == ([str(py)], True)
    sh = tmp_path / "job.sh"
    sh.write_bytes(b"echo hi\n")
    assert scripts.script_command(sh) == (["bash", str(sh)], False)
    sh.write_bytes(b"#!/bin/sh\necho hi\n")
    assert scripts.script_command(sh) == (["/bin/sh", str(sh)], False)


def test_crlf_shell_script_is_refused(tmp_path):
    sh = tmp_path / "run.sh"
    sh.write_bytes(b"#!/bin/bash\r\necho hi\r\n")
    with pytest.raises(UsageError) as e:
        scripts.script_command(sh)
    assert "CRLF" in str(e.value) and f"sed -i 's/\\r$//' {sh}" in str(e.value)
    tool = tmp_path / "tool"
    tool.write_bytes(b"#!/usr/bin/env bash\r\necho hi\n")
    with pytest.raises(UsageError, match="shebang"):
        scripts.script_command(tool)


def test_module_source(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('must not be imported')")
    (tmp_path / "pkg" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert scripts.module_source("pkg.train") == tmp_path / "pkg" / "train.py"
    with pytest.raises(UsageError, match="-m no_such_module_xyz: no module"):
        scripts.module_source("no_such_module_xyz")


def test_a_dotted_module_whose_package_is_nowhere_is_refused_before_any_process(tmp_path, monkeypatch):
    """`multigpu run -m nopkg.train` (and doctor, --auto) said nothing and started every process,
    each failing on the import; a package that is there, as a folder of the cwd or on sys.path,
    is left to the run (its submodule may be an extension, or made by the package)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as err:
        scripts.module_source("no_such_pkg_xyz.train")
    assert str(err.value) == (f"-m no_such_pkg_xyz.train: no module of that name on sys.path "
                              f"(cwd {tmp_path}); check the name, or run the script by its path")
    (tmp_path / "pkg").mkdir()
    assert scripts.module_source("pkg.not_a_file") is None
    assert scripts.module_source("json.no_such_submodule") is None


@pytest.mark.parametrize("value", ["-1", "0.5", "inf", "nan"])
def test_a_bad_hang_timeout_is_one_line_with_the_fix(no_slurm, value):
    with pytest.raises(UsageError, match=r"--hang-timeout .*: give seconds \(at least 1, e.g. "
                                         r"--hang-timeout 300\), or 0 to turn the watchdog off"):
        launch.options_from_args(parse("--hang-timeout", value))


def test_workers_get_the_hang_timeout_the_log_dir_and_the_flight_recorder(tmp_path):
    with launch.child_environment(CPU2, LaunchOptions(hang_timeout=20), str(tmp_path)):
        assert os.environ["MULTIGPU_HANG_TIMEOUT"] == "20"
        assert os.environ["MULTIGPU_LOG_DIR"] == str(tmp_path.resolve())
        assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path.resolve() / "nccl_trace_rank_")
        assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert "MULTIGPU_HANG_TIMEOUT" not in os.environ


def test_the_header_says_where_each_rank_s_output_goes():
    opts = LaunchOptions()
    rdzv = plan_rendezvous(opts)
    assert launch.header(CPU2, opts, rdzv, "runs/x/logs") == (
        "2 CPU processes (gloo); rank 0 shown here, the other ranks logged in runs/x/logs")
    assert launch.header(DevicePlan("cpu", (), 1), opts, rdzv, "runs/x/logs") == (
        "1 CPU process (gloo); its output shown here")  # nothing is written to the log folder
    tee = LaunchOptions(tee=True)
    assert launch.header(CPU2, tee, plan_rendezvous(tee), "L").endswith(
        "; every rank shown here and logged in L")


def test_a_second_rank_failing_like_the_console_rank_is_not_printed_again(tmp_path):
    """Rank 1 failed first; rank 0, on the console, failed the same way: the report names rank 1
    and points at rank 0's traceback above instead of printing the same one again."""
    from types import SimpleNamespace

    from multigpu.launcher import launch_failures

    tb = ("Traceback (most recent call last):\n  File \"x.py\", line 3\n"
          "RuntimeError: Expected to have finished reduction")
    texts = {1: tb, 0: tb.replace("line 3", "line 4")}
    one = SimpleNamespace(exitcode=1, local_rank=1)
    zero = SimpleNamespace(exitcode=1, local_rank=0)
    failures = [(1, one), (0, zero)]
    assert launch_failures._same_error_shown_above(failures, texts, 1, [tmp_path]) == 0
    texts[0] = tb.replace("finished reduction", "something else")  # another error: printed
    assert launch_failures._same_error_shown_above(failures, texts, 1, [tmp_path]) is None
    texts[0] = tb
    # stopped by the agent's SIGTERM after its own traceback (its error file holds it; it waited
    # for its peers at exit): it failed on its own and printed it
    zero.exitcode = -15
    assert launch_failures._same_error_shown_above(failures, texts, 1, [tmp_path]) == 0
    texts[0] = "RuntimeError: Connection closed by peer"  # stopped while echoing a lost peer: no
    assert launch_failures._same_error_shown_above(failures, texts, 1, [tmp_path]) is None


TWIN_TRACEBACK = """Traceback (most recent call last):
  File "train.py", line 9, in <module>
    loss.backward()
RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one.
Parameter indices which did not receive grad for rank {rank}: 2 3
 In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL
"""


@pytest.mark.parametrize("rank_0_ended", [1, -15])
def test_a_rank_failing_as_rank_0_did_names_rank_0_s_error_instead_of_a_second_traceback(
        tmp_path, capsys, rank_0_ended):
    """Rank 1 failed first; rank 0 failed the same way and printed its traceback on the console,
    then exited (1) or was stopped by the agent's SIGTERM before its own exit (-15, seen under
    load): the report names the exception's first line, not a second traceback."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    d = tmp_path / "run_abc" / "attempt_0" / "1"
    d.mkdir(parents=True)
    (d / "stderr.log").write_text(TWIN_TRACEBACK.format(rank=1))
    error_file = tmp_path / "error0.json"
    error_file.write_text(json.dumps({"message": TWIN_TRACEBACK.format(rank=0), "timestamp": 1}))
    failures = {1: ProcessFailure(1, 101, 1, str(tmp_path / "missing.json")),
                0: ProcessFailure(0, 100, rank_0_ended, str(error_file))}
    code = launch_failures.report_child_failed(ChildFailedError("x", failures), str(tmp_path))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert "multigpu: its error is the one rank 0 printed above: RuntimeError: Expected to have " \
           "finished reduction in the prior iteration before starting a new one." in err, err
