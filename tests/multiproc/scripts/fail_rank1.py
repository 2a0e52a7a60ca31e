"""Rank 1 raises; the other ranks wait, as if stuck in a collective, until they are stopped."""
import os
import time

if os.environ["RANK"] == "1":
    time.sleep(0.3)
    raise ValueError("boom-rank-1")
time.sleep(60)
