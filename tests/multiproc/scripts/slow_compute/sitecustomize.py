"""Slows one rank of a `multigpu train` run in its compute, as a slow GPU would: each training
loss (the compute between the forward and the gradients) sleeps SLOW_MS on rank SLOW_COMPUTE_RANK."""
import os

if os.environ.get("RANK") is not None and os.environ.get("RANK") == os.environ.get("SLOW_COMPUTE_RANK"):
    import time

    import torch
    import torch.nn.functional as F

    _loss = F.cross_entropy

    def cross_entropy(*args, **kwargs):
        if torch.is_grad_enabled():
            time.sleep(float(os.environ.get("SLOW_MS", "20")) / 1e3)
        return _loss(*args, **kwargs)

    F.cross_entropy = cross_entropy
