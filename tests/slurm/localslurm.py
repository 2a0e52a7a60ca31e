"""A real SLURM on localhost: munged, slurmctld and one slurmd (Debian's slurm-wlm and munge;
.ci/run installs them), for the tests in tests/slurm (conftest.slurm_cluster) and for
benchmarks/sweep_outputs.sh, which holds one up with `python -m tests.slurm.localslurm DIR`.

With nodes=2 (conftest.slurm_two_nodes), two slurmd on this one machine make a cluster of two
nodes, this machine's host name (127.0.0.1) and that name + "-n2" (127.0.0.2), each started
with -N NAME and its own port, spool folder, pid and log file (slurm.conf's Port= and %n;
Debian's slurmd takes them): a job of two nodes runs one task on each, as on two machines.
Node 0's name must resolve (the launcher's rendezvous meets there) and come first in a sorted
node list; `localhost` would, but slurmd refuses a second node beside a node of that name
("Duplicated NodeHostName").

Everything lives under one folder: the munge key and socket, slurm.conf (one node `localhost`
with 4 CPUs whatever the machine has, config_overrides; no cgroups: proctrack/linuxproc,
task/none; partition `debug`), state, spool, logs, and TCP ports picked free. The daemons run in
the foreground, children of this process, and are ended by their pids. Client commands (sbatch,
squeue, scancel) find this cluster through SLURM_CONF in `Cluster.env`.

A daemon that does not start raises SlurmStartError with its log: CI installs SLURM, so the
tests fail on it rather than skip, which would hide a broken tier.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator

from multigpu.core.system.orphans import set_death_signal

NODE_CPUS = 4
PARTITION = "debug"
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
{node_lines}
PartitionName={partition} Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""


def node_names(nodes: int) -> list[str]:
    return ["localhost"] if nodes == 1 else [socket.gethostname(), f"{socket.gethostname()}-n2"]


class SlurmStartError(RuntimeError):
    """SLURM is missing, we are not root, or a daemon did not come up (the message has the logs)."""


@dataclass
class Cluster:
    root: Path
    env: dict  # os.environ with SLURM_CONF: give it to every process that talks to this SLURM

    def run(self, *argv, check=True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=120, check=check)

    def logs(self) -> str:
        parts = []
        slurmd = sorted(p.name for p in self.root.glob("slurmd*.log")) or ["slurmd.log"]
        for name in ("munge/munged.log", "slurmctld.log", *slurmd):
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


def _check_can_start() -> None:
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(p) is None
               and not Path("/usr/sbin", p).exists()]
    if missing:
        raise SlurmStartError(f"{', '.join(missing)} not found: install SLURM (apt-get install "
                              "slurm-wlm munge; .ci/run does it)")
    if os.geteuid() != 0:
        raise SlurmStartError("slurmd must run as root to start jobs; run as root (CI does)")


def _configure(root: Path, nodes: int = 1) -> tuple:
    """The munge key and slurm.conf under `root`; returns (key, conf)."""
    names = node_names(nodes)
    for sub in ("munge", "state", "spool", *(f"spool-{n}" for n in names if nodes > 1)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    text = CONF.format(root=root, ctld_port=_free_port(), slurmd_port=_free_port(),
                       partition=PARTITION, node_lines=_node_lines(names),
                       node_names=",".join(names))
    if nodes > 1:  # each slurmd its own files: %n is the node's name
        for item in ("SlurmdSpoolDir={r}/spool", "SlurmdPidFile={r}/slurmd", "SlurmdLogFile={r}/slurmd"):
            text = text.replace(item.format(r=root), item.format(r=root) + "-%n")
    conf.write_text(text)
    return key, conf


def _node_lines(names) -> str:
    if len(names) == 1:
        return f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN"
    return "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.{i + 1} "
                     f"Port={_free_port()} CPUs={NODE_CPUS} State=UNKNOWN"
                     for i, name in enumerate(names))


@contextmanager
def local_slurm(root: Path, nodes: int = 1) -> Iterator[Cluster]:
    """munged, slurmctld and a slurmd per node (1 or 2) under `root` until the block ends; then
    the cluster's jobs are cancelled and the daemons stopped (last started first), whatever
    ended the block."""
    _check_can_start()
    root = Path(root).resolve()
    key, conf = _configure(root, nodes)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [_start([sbin("munged"), "--foreground", "--force", f"--key-file={key}",
                     f"--socket={root}/munge/munge.socket", f"--log-file={root}/munge/munged.log",
                     f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/seed"],
                    root / "munge" / "console.log", env)]
    cluster = Cluster(root, env)
    try:
        procs.append(_start([sbin("slurmctld"), "-D", "-f", str(conf)], root / "slurmctld.console", env))
        for name in node_names(nodes):
            console = f"slurmd-{name}.console" if nodes > 1 else "slurmd.console"
            procs.append(_start([sbin("slurmd"), "-D", "-f", str(conf), "-N", name], root / console, env))
        _wait_idle(cluster, procs)
        yield cluster
    finally:
        _stop(cluster, procs)


def _stop(cluster: Cluster, procs) -> None:
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
    """Until sinfo shows the node idle; a daemon that exits or a deadline raises with the logs."""
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        dead = [p.args[0] for p in procs if p.poll() is not None]
        if dead:
            raise SlurmStartError(f"{dead[0]} exited at start\n{cluster.logs()}")
        out = cluster.run("sinfo", "-h", "-o", "%T", check=False)
        if out.returncode == 0 and out.stdout.strip() == "idle":
            return
        time.sleep(0.5)
    raise SlurmStartError(f"the localhost SLURM node is not idle after {START_DEADLINE_S} s "
                          f"(sinfo: {out.stdout.strip() or out.stderr.strip()})\n{cluster.logs()}")


def _stop_on_signal(signum, frame):
    """Unwind through local_slurm's cleanup; a second signal must not cut that cleanup short."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv) -> int:
    """Hold a cluster under DIR until SIGTERM, SIGINT or SIGHUP: DIR/slurm.env (`SLURM_CONF=...`
    and `PARTITION=...`) appears once the node is idle, for a shell script to wait on and source."""
    if len(argv) != 1:
        print("usage: python -m tests.slurm.localslurm DIR", file=sys.stderr)
        return 2
    root = Path(argv[0]).resolve()
    # a session of its own: the terminal's Ctrl-C goes to the script, which stops us in order
    # (jobs cancelled, then the daemons); SIGTERM too if the script itself dies
    try:
        os.setsid()
    except OSError:  # already a process group's leader: started with a session of its own
        pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    set_death_signal(signal.SIGTERM)
    try:
        with local_slurm(root) as cluster:
            ready = root / "slurm.env"
            ready.with_suffix(".tmp").write_text(
                f"SLURM_CONF={cluster.env['SLURM_CONF']}\nPARTITION={PARTITION}\n")
            ready.with_suffix(".tmp").rename(ready)
            while True:
                signal.pause()
    except SlurmStartError as e:
        print(f"localslurm: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
