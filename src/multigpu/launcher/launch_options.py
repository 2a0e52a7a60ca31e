"""What a launch is asked for (machines, rendezvous, restarts, logs, the hang watchdog), as one
value: made from the launch flags (launch.options_from_args) or by a command that launches
(doctor's trial, the self-test, bench), and read by the launcher, the rendezvous plan (ports)
and the failure report (launch_failures).
"""
from __future__ import annotations

from dataclasses import dataclass

from multigpu.launcher.rank import watchdog

# time.time() when the launcher handed over to torchrun's agent, in every worker's environment:
# a worker's `time:` line splits the launch there (train/rundir/timeline.py)
AGENT_STARTED_ENV = "MULTIGPU_AGENT_STARTED_AT"


@dataclass
class LaunchOptions:
    nnodes: str = "1"  # "N" or "MIN:MAX" (elastic)
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    start_timeout: float = 300.0  # seconds for the rendezvous to complete
    max_restarts: int = 0
    tee: bool = False  # show every rank's output with a rank prefix
    log_dir: str | None = None  # per-rank logs go here (default: runs/logs/<time>-<pid>)
    hang_timeout: float = watchdog.DEFAULT_HANG_TIMEOUT  # 0: no hang watchdog
    min_devices: int | None = None  # a lost device dropped while at least this many are left
    device_health: str | None = None  # the site's health command (device_health)
