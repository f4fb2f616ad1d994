"""`python -m runner ...` is `python -m experiments.run ...`."""

from runner.main import cli

cli()
