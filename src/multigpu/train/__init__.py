"""The `multigpu train` application: the training loop and its job (models, data sets, the image
folder pipeline, optimizer and schedule), the run folder and its state, checkpoints of a run,
logs, curves and the configuration that `multigpu train` and config.json set.

It runs inside the workers that the launcher (multigpu.launcher, below) starts, on the library
(multigpu.core, below that), and uses the launcher's worker-side pieces (the watchdog, the note
of a restart). The checks of a run's setup that `multigpu train` fires itself (checks/setup_checks,
returning core's Finding) live here so the loop can use them; `multigpu doctor`, above, prints
them with its other findings. settings/flagwords says the library's API names as this
application's flags, for every command above.
"""
