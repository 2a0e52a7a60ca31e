"""A run's checkpoints: the store, the writer, the run's state, resume."""
