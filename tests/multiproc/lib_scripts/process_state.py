"""setup() in a 2-process run under `multigpu run`: what it changes of the process around it.

argv: OUT [--install-hooks]. Each rank writes OUT/rank<R>.json: the module of sys.excepthook
after setup() where it changed (torch's init_process_group installs one of its own on newer
torch), how many atexit handlers setup() added, and the environment variables it set or changed.
"""
import atexit
import json
import os
import sys
from pathlib import Path

import multigpu

hook, handlers, environ = sys.excepthook, atexit._ncallbacks(), dict(os.environ)
rt = multigpu.setup("ddp", accelerator="cpu", install_hooks="--install-hooks" in sys.argv)
changed = sorted(k for k, v in os.environ.items() if environ.get(k) != v)
state = {"excepthook_by": None if sys.excepthook is hook else sys.excepthook.__module__,
         "atexit_added": atexit._ncallbacks() - handlers, "env_changed": changed}
Path(sys.argv[1], f"rank{rt.rank}.json").write_text(json.dumps(state))
rt.env.barrier()
