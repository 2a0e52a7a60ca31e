"""A torchrun-style script: reads the launcher's environment, writes what it saw to OUT_DIR."""
import json
import os
import sys

out_dir = sys.argv[1]
seen = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                       "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
                                       "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                       "NVSHMEM_DISABLE_NVLS")}
seen["argv"] = sys.argv[2:]
print(f"rank {seen['RANK']} of {seen['WORLD_SIZE']} says hello", flush=True)
with open(os.path.join(out_dir, f"rank{seen['RANK']}.json"), "w") as f:
    json.dump(seen, f)
