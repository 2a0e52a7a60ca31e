"""The run folder and what is written in it: logs, provenance, plots, timeline."""
