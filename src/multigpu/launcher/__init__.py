"""The launcher: chooses the devices, ports and process count, starts the workers through torch's
elastic agent (launch), and the worker's side of that contract: the hang watchdog, the failure
report, the start of a user's script (worker, scripts) and the doctor's trial hooks (trial).

It sits on the library (multigpu.core) and knows nothing of what the workers run: the `multigpu
train` application above it uses the worker-side pieces (watchdog.start_from_env,
launch_failures.restart_note), so they live here, below it, rather than the launcher reaching
up. Workers start as `python -m multigpu.launcher.rank.worker`.
"""
