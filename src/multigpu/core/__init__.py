"""The library: what `import multigpu` gives (setup, Runtime, strategies, precision, data plans,
metrics, checkpoints of a model and its optimizer), and the plain helpers every layer above uses
(errors, console, system/fileio).

The lowest layer: it imports nothing of multigpu outside itself, so a library user's script pulls
in no launcher, no `multigpu train` application and no command line. `system/orphans` lives
here because `distributed.launcher_gone()` asks it whether this worker's launcher has died; it
imports nothing and any process started by a launcher (the library's own scripts too) may use it.
"""
