"""The runner: from a command line to a finished run directory.

config (typed Hydra schemas, validated before any model loads), task_config (the task group's
dataclasses), jobs (finds the probes and experiments by their module convention), context (the
model, the items and the Context an experiment receives), rundir (run directories: lock, units,
records, summary), main (the Hydra entry point), summarize (rebuild a summary from records).
Jobs never import this package; it imports them. docs/ARCHITECTURE.md draws the arrows.
"""
