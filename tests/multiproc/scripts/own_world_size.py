"""Sets WORLD_SIZE itself before joining, as scripts written for hand-launched DDP do. The value
comes from a setting, as in a script that reads its launch settings from a config file: out of
sight of `multigpu run`'s check of the script's text, so the running workers must catch it."""
import os

import torch.distributed as dist

settings = {"WORLD_SIZE": "3"}
for name, value in settings.items():
    os.environ[name] = value
dist.init_process_group("gloo")
