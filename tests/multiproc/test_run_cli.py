"""`multigpu run` for real: CPU processes on gloo, started through multigpu's launcher.

Each test starts `python -m multigpu run ...` as a subprocess, the way a user does. The scripts in
scripts/ are tiny and most do not import torch, to keep the file quick on a 2-core machine.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher or SLURM variables that would change the test."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return env | extra


def multigpu(*args: str, cwd: Path, timeout: float = 120, **env: str):
    return subprocess.run([sys.executable, "-m", "multigpu", "run", *args], cwd=cwd,
                          env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


def start(*args: str, cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "multigpu", "run", *args], cwd=cwd,
                            env=clean_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ranks_seen(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def free_port() -> int:
    # Test-only: pick a port for the two "nodes" to agree on (the launcher never does this).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.smoke
def test_torchrun_style_script_gets_rank_env_and_untouched_args(tmp_path):
    r = multigpu("--devices", "cpu:2", str(SCRIPTS / "report_env.py"), str(tmp_path),
                 "--devices", "7", "--local_rank", "x", cwd=tmp_path, NCCL_NVLS_ENABLE="1")
    assert r.returncode == 0, r.stderr
    seen = ranks_seen(tmp_path)
    assert sorted(seen) == [0, 1]
    for rank, s in seen.items():
        assert (s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert s["argv"] == ["--devices", "7", "--local_rank", "x"]  # passed through untouched
        assert s["CUDA_VISIBLE_DEVICES"] == ""  # cpu:N hides GPUs: children pick gloo
        # NCCL's settings pass through as the user set them (or not): no site rule is added
        assert (s["NCCL_NVLS_ENABLE"], s["TORCH_SYMM_MEM_DISABLE_MULTICAST"],
                s["NVSHMEM_DISABLE_NVLS"]) == ("1", os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"),
                                               os.environ.get("NVSHMEM_DISABLE_NVLS"))
    assert "multigpu: 2 CPU processes (gloo)" in r.stderr  # the one line before launching
    assert "rank 0 of 2 says hello" in r.stdout and "rank 1" not in r.stdout  # rank 0 only
    logs = list((tmp_path / "runs" / "logs").glob("*/*/attempt_0/1/stdout.log"))
    assert logs and "rank 1 of 2 says hello" in logs[0].read_text()  # rank 1 went to its log


def test_module_with_tee_shows_every_rank(tmp_path):
    r = multigpu("--tee", "--devices", "cpu:2", "--log-dir", str(tmp_path / "logs"),
                 "-m", "report_env", str(tmp_path), "a", cwd=tmp_path,
                 PYTHONPATH=os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    assert r.returncode == 0, r.stderr
    assert sorted(ranks_seen(tmp_path)) == [0, 1] and ranks_seen(tmp_path)[1]["argv"] == ["a"]
    assert "[rank0]:rank 0 of 2 says hello" in r.stdout
    assert "[rank1]:rank 1 of 2 says hello" in r.stdout


def test_legacy_local_rank_script(tmp_path):
    r = multigpu("--devices", "cpu:2", str(SCRIPTS / "legacy_local_rank.py"), "--out",
                 str(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "parses --local_rank" in r.stderr
    seen = ranks_seen(tmp_path)
    assert {k: v["local_rank_arg"] for k, v in seen.items()} == {0: 0, 1: 1}
    assert {k: v["LOCAL_RANK"] for k, v in seen.items()} == {0: "0", 1: "1"}


def cli(*args: str) -> int:
    """`multigpu run ...` in this process, for mistakes caught before anything starts."""
    from multigpu.cli import main

    return main(["run", *args])


def test_shell_script_runs_and_crlf_is_refused(tmp_path, capsys):
    sh = tmp_path / "job.sh"
    sh.write_text('echo "rank $RANK of $WORLD_SIZE" > "$1/rank$RANK.txt"\n')
    r = multigpu("--devices", "cpu:2", str(sh), str(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rank1.txt").read_text() == "rank 1 of 2\n"
    sh.write_bytes(b'echo "rank $RANK"\r\n')
    assert cli("--devices", "cpu:2", str(sh)) == 2
    err = capsys.readouterr().err
    assert "sed -i 's/\\r$//'" in err and "Traceback" not in err


@pytest.mark.smoke
def test_missing_script_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli("--devices", "cpu:2", "no_such_train.py") == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"multigpu: error: script 'no_such_train.py' not found (in {tmp_path}); give the path of "
        "a Python script, or -m package.module to run a module"]


def test_port_29500_taken_by_someone_else(tmp_path, capsys):
    holder = socket.socket()
    try:
        holder.bind(("0.0.0.0", 29500))
        holder.listen()
    except OSError:
        pass  # already held by another process: the condition we want anyway
    try:
        r = multigpu("--devices", "cpu:1", str(SCRIPTS / "report_env.py"), str(tmp_path),
                     cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert ranks_seen(tmp_path)[0]["MASTER_PORT"] != "29500"
        # naming the taken port is a clear one-line error naming the holder
        assert cli("--master-port", "29500", "--devices", "cpu:1",
                   str(SCRIPTS / "report_env.py"), str(tmp_path)) == 2
        err = capsys.readouterr().err
        assert "--master-port 29500: the port is already in use" in err
        if holder.fileno() != -1 and holder.getsockname()[1] == 29500:
            assert f"pid {os.getpid()}" in err
        assert "leave out --master-port" in err and len(err.strip().splitlines()) == 1
    finally:
        holder.close()


@pytest.mark.extended
def test_four_runs_started_at_once_all_start(tmp_path, procs):
    outs = [tmp_path / f"job{i}" for i in range(4)]
    for out in outs:
        out.mkdir()
        procs.append(start("--devices", "cpu:2", str(SCRIPTS / "report_env.py"), str(out),
                           cwd=tmp_path))
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err for _, err in results]
    ports_used = set()
    for out in outs:
        seen = ranks_seen(out)
        assert sorted(seen) == [0, 1]
        ports_used.add(seen[0]["MASTER_PORT"])
    assert len(ports_used) == 4  # each job has its own rendezvous port


def test_two_nodes_on_loopback(tmp_path, procs):
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--rdzv-endpoint", endpoint, "--devices", "cpu:2",
              "--start-timeout", "90")
    script = (str(SCRIPTS / "allreduce.py"), str(tmp_path), "4")
    procs.append(start(*common, "--node-rank", "1", *script, cwd=tmp_path))  # order must not matter
    time.sleep(0.5)
    procs.append(start(*common, "--node-rank", "0", *script, cwd=tmp_path))
    results = [p.communicate(timeout=150) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    seen = ranks_seen(tmp_path)
    assert sorted(seen) == [0, 1, 2, 3]
    assert {s["world"] for s in seen.values()} == {4} and {s["sum"] for s in seen.values()} == {10}
    assert sorted(s["group_rank"] for s in seen.values()) == ["0", "0", "1", "1"]


def test_on_a_second_node_the_failed_rank_is_named_by_its_global_rank_and_node(tmp_path, procs):
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--rdzv-endpoint", endpoint, "--devices", "cpu:2", "--start-timeout", "90")
    script = (str(SCRIPTS / "fail_rank1.py"), "3")  # node 1 runs global ranks 2 and 3
    procs.append(start(*common, "--node-rank", "0", *script, cwd=tmp_path))
    procs.append(start(*common, "--node-rank", "1", *script, cwd=tmp_path))
    _, err = procs[1].communicate(timeout=150)
    assert procs[1].returncode == 1, err
    assert "this node's local rank 0 shown here" in err
    assert f"rank 3 failed first on node 1 ({socket.gethostname()}) (exit code 1, local rank 1" in err
    assert "ValueError: boom-rank-3" in err


def test_a_rank_failing_once_on_a_second_node_restarts_every_node_s_ranks(tmp_path, procs):
    """Node 1's local rank 1 exits 1 once, before the group forms: node 1 restarts (its restart
    line), node 0 sees it waiting in the rendezvous and restarts too, in step (attempt_1 on
    both), and the second attempt's four ranks all-reduce to the end."""
    endpoint = f"127.0.0.1:{free_port()}"
    common = ("--nnodes", "2", "--rdzv-endpoint", endpoint, "--devices", "cpu:2",
              "--start-timeout", "90", "--max-restarts", "1")
    script = (str(SCRIPTS / "allreduce.py"), str(tmp_path), "4")
    for node, env in (("0", {}), ("1", {"FAIL_ONCE": str(tmp_path / "failed")})):
        procs.append(start(*common, "--node-rank", node, "--log-dir", str(tmp_path / f"logs{node}"),
                           *script, cwd=tmp_path, **env))
    results = [p.communicate(timeout=150) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in results]
    assert (tmp_path / "failed").exists()
    node1_said = [line for line in results[1][1].splitlines() if "restarting" in line]
    assert len(node1_said) == 1 and node1_said[0].startswith("multigpu: warning: rank ")
    assert node1_said[0].endswith("exited with code 1; restarting all workers (restart 1 of 1)")
    assert "a node is waiting in the rendezvous" in results[0][1] + results[1][1]
    for node in ("0", "1"):
        assert sorted(p.name for p in (tmp_path / f"logs{node}").glob("*/attempt_*")) == \
            ["attempt_0", "attempt_1"]
    seen = ranks_seen(tmp_path)
    assert sorted(seen) == [0, 1, 2, 3]
    assert {(s["world"], s["sum"], s["restart"]) for s in seen.values()} == {(4, 10.0, "1")}


def test_start_timeout_when_second_node_never_comes(tmp_path):
    t0 = time.monotonic()
    r = multigpu("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                 f"127.0.0.1:{free_port()}", "--start-timeout", "6", "--devices", "cpu:1",
                 str(SCRIPTS / "report_env.py"), str(tmp_path), cwd=tmp_path, timeout=90)
    assert r.returncode == 1, r.stderr
    assert "did not complete within --start-timeout 6 s: 1 of 2 nodes joined" in r.stderr
    assert "--node-rank" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.smoke
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.extended)])
def test_signal_stops_every_rank(tmp_path, procs, sig):
    p = start("--devices", "cpu:2", str(SCRIPTS / "sleeper.py"), str(tmp_path), cwd=tmp_path)
    procs.append(p)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 2:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.2)
    tree = psutil.Process(p.pid).children(recursive=True)
    worker_pids = {int(f.read_text()) for f in tmp_path.glob("pid*")}
    assert worker_pids <= {c.pid for c in tree}
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + sig
    assert f"stopped by {sig.name}" in err
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"orphans left: {alive}"


@pytest.mark.smoke
def test_failing_rank_traceback_is_shown(tmp_path):
    r = multigpu("--devices", "cpu:2", "--log-dir", str(tmp_path / "logs"),
                 str(SCRIPTS / "fail_rank1.py"), cwd=tmp_path)
    assert r.returncode == 1
    err = r.stderr
    assert "rank 1 failed first (exit code 1" in err
    assert 'raise ValueError("boom-rank-1")' in err and "ValueError: boom-rank-1" in err
    assert "also stopped: rank 0" in err and str(tmp_path / "logs") in err
    assert err.rstrip().endswith(str(tmp_path / "logs"))  # the summary comes last


def test_a_group_left_alive_is_still_there_for_a_late_thread_and_the_ranks_end_cleanly(tmp_path):
    proc = start("--devices", "cpu:2", str(SCRIPTS / "group_left_alive.py"), str(tmp_path), cwd=tmp_path)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen == [{"late_sum": 2.0}] * 2
    assert "Traceback" not in stderr and "note: tearing down" not in stderr


def test_a_script_that_exits_2_silently_is_reported_as_a_failed_rank(tmp_path):
    (tmp_path / "two.py").write_text("import sys\nsys.exit(2)\n")
    proc = multigpu("--devices", "cpu:2", "two.py", cwd=tmp_path)
    assert proc.returncode == 2
    assert "failed first (exit code 2" in proc.stderr and "logs of every rank: " in proc.stderr, proc.stderr
