"""Data loading: the exact sampler, the prepared loaders and their workers, the global batch."""
