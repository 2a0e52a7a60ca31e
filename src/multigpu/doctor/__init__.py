"""`multigpu doctor`: the traps of docs/traps.md looked for before a run, one line each.

- multigpu.core.findings: a Finding (ok / warn / fail, the check, the cause and the fix) and how
  it is shown;
- script_checks.py: a user's Python script read (never run) for the traps a source shows, through
  pysource.py (its imports, bindings and calls, parsed with ast); wrapper_checks.py: the checks of
  its DataParallel and DDP wrappers among them;
- script_trial.py: then the script run through the launcher up to its first optimizer step(s),
  and what its ranks saw there (multigpu.launcher.rank.trial in each worker);
- auto_checks.py, auto_trial.py: `doctor --auto`: what `multigpu run --auto` will change in a
  one-device script, at its lines, then the script's first step under --auto's own worker;
- shell_checks.py: the same for a shell script or a file on a command line (CRLF, old launcher);
- multigpu.train.checks.setup_checks: the launch environment, the devices and the plan of a `multigpu
  train` run (in the train layer, below: the training loop says its last-step line with it);
- selftest.py: what `multigpu test` runs in each worker (collectives, DDP steps, checkpoints);
- probe.py: one real training and evaluation step: peak memory, unused parameters, the batch
  that fits;
- timing.py: the estimate of a `multigpu train` run from real steps timed on the probe's device;
- scaling.py: `doctor --scaling`: N devices against one, measured through `multigpu bench`.

Each check is a function of the library, so `multigpu train` and `multigpu run` fire the cheap
ones too, once, before they start any process.
"""
