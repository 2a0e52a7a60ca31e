"""A real SLURM on localhost for the tests that need one: munged, slurmctld and one slurmd
(Debian's slurm-wlm and munge; .ci/run installs them), started once per session by
`slurm_cluster` and stopped after.

Everything lives under a temporary folder: the munge key and socket, slurm.conf (one node
`localhost` with 4 CPUs whatever the machine has, config_overrides; no cgroups:
proctrack/linuxproc, task/none), state, spool, logs, and TCP ports picked free. The daemons run
in the foreground, children of pytest, and are ended by their pids. Client commands (sbatch,
squeue, scancel) find this cluster through SLURM_CONF in `cluster.env`, which tests pass to the
processes they start (the environment of pytest itself is restored after each test).

A daemon that does not start fails the test with its log: CI installs SLURM, so a skip there
would hide a broken tier.
"""
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

NODE_CPUS = 4
START_DEADLINE_S = 90

CONF = """\
ClusterName=multigputest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again this many seconds later (the default is 120)
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=5
MailProg=/bin/true
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    root: Path
    env: dict  # os.environ with SLURM_CONF: give it to every process that talks to this SLURM

    def run(self, *argv, check=True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=120, check=check)

    def logs(self) -> str:
        parts = []
        for name in ("munge/munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            text = path.read_text(errors="replace") if path.exists() else "(none)"
            parts.append(f"--- {name} (last lines)\n" + "\n".join(text.splitlines()[-25:]))
        return "\n".join(parts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"  # root's daemons, off a user's PATH


def _start(argv, log: Path, env) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(p) is None
               and not Path("/usr/sbin", p).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not found: install SLURM (apt-get install slurm-wlm "
                    "munge; .ci/run does it)")
    if os.geteuid() != 0:
        pytest.fail("slurmd must run as root to start jobs; run these tests as root (CI does)")
    root = Path(tmp_path_factory.mktemp("slurm"))
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(root=root, ctld_port=_free_port(), slurmd_port=_free_port(),
                                cpus=NODE_CPUS))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [_start([sbin("munged"), "--foreground", "--force", f"--key-file={key}",
                     f"--socket={root}/munge/munge.socket", f"--log-file={root}/munge/munged.log",
                     f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/seed"],
                    root / "munge" / "console.log", env)]
    cluster = Cluster(root, env)
    try:
        procs.append(_start([sbin("slurmctld"), "-D", "-f", str(conf)], root / "slurmctld.console", env))
        procs.append(_start([sbin("slurmd"), "-D", "-f", str(conf), "-N", "localhost"],
                            root / "slurmd.console", env))
        _wait_idle(cluster, procs)
        yield cluster
    finally:
        for job in set(cluster.run("squeue", "-h", "-o", "%F", check=False).stdout.split()):
            cluster.run("scancel", job, check=False)
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_idle(cluster: Cluster, procs) -> None:
    """Until sinfo shows the node idle; a daemon that exits or a deadline fails with the logs."""
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead:
            pytest.fail(f"{dead[0]} exited at start\n{cluster.logs()}")
        out = cluster.run("sinfo", "-h", "-o", "%T", check=False)
        if out.returncode == 0 and out.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    pytest.fail(f"the localhost SLURM node is not idle after {START_DEADLINE_S} s "
                f"(sinfo: {out.stdout.strip() or out.stderr.strip()})\n{cluster.logs()}")
