"""What runs inside each rank: the worker, its watchdog, trials, stop reasons, the step record."""
