"""Rank 1 (or the global rank given as the first argument) raises; the other ranks wait, as if
stuck in a collective, until they are stopped."""
import os
import sys
import time

failing = sys.argv[1] if len(sys.argv) > 1 else "1"
if os.environ["RANK"] == failing:
    time.sleep(0.3)
    if failing == "1":
        raise ValueError("boom-rank-1")  # a test reads this line in the traceback shown
    raise ValueError(f"boom-rank-{failing}")
time.sleep(60)
