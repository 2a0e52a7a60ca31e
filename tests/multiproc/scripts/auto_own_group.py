"""A script that is distributed already: it forms its own process group (as torchrun scripts do)."""
import torch.distributed as dist

dist.init_process_group("gloo")
print("formed a group of", dist.get_world_size())
