import signal
import sys

# A worker of multigpu's launcher (`multigpu train` on several devices) watches its launcher from
# here, before the CLI and torch are imported: one killed during start-up ends it too. A Ctrl-C
# the launcher passes on ends it at once until its training loop takes the signal over
# (startup_sigint.py). It holds the run folder while it lives (folder_users.py).
try:
    from multigpu.core.system import orphans
    from multigpu.core import startup_sigint

    if orphans.watch_from_env() is not None:
        startup_sigint.guard()
        from multigpu.train.rundir import folder_users

        folder_users.hold_from_env()
    else:  # (a rank is born with SIGINT blocked: local_loop)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    from multigpu.cli import entry
except KeyboardInterrupt:  # Ctrl-C in the first moments (of the launcher): one line, as later
    print("multigpu: interrupted", file=sys.stderr)
    sys.exit(130)

entry()
