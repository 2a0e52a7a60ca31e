"""multigpu sweep: one command over a grid of settings, packed onto the free devices."""
