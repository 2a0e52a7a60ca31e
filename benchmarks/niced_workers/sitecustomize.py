"""Put first on PYTHONPATH for one setting of a benchmark (epoch_threads.py's NAME:PYTHONPATH=...):
every process forked from a process that starts with it (a run's DataLoader workers) runs at a
nice value NICED_WORKERS (default 5) higher, so that where the workers fill every core the rank's
own threads (the main one, autograd's, the pinning one) win a contended core. A benchmark's
question, not the product's: nothing else changes."""
import os

_NICE = int(os.environ.get("NICED_WORKERS", "5"))
os.register_at_fork(after_in_child=lambda: os.nice(_NICE))
