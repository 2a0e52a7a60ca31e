"""The launcher: chooses the devices, ports and process count (devices, leases, ports, sysinfo,
cluster_env, launch_options) and starts the ranks (launch) with its own loop on torch's public
process, store and rendezvous API (local_loop, local_rendezvous, sessions; several machines meet
in torch's c10d rendezvous, node_rendezvous); launch_common is what a launch holds, launch_failures
what is said when a launch fails, scripts how a user's script is started. health/ tells a lost device
and goes on without it (--min-devices); rank/ is the worker's side of that contract: the worker,
its hang watchdog, doctor's trial hooks, stop reasons, the step record.

It sits on the library (multigpu.core) and knows nothing of what the workers run: the `multigpu
train` application above it uses the worker-side pieces (watchdog.start_from_env,
launch_failures.restart_note), so they live here, below it, rather than the launcher reaching
up. Workers start as `python -m multigpu.launcher.rank.worker`.
"""
