"""`python -m runner ...` is `python -m experiments.run ...`."""

from runner import harness

harness.check()  # before runner.main imports Hydra (runner/harness.py)
from runner.main import cli  # noqa: E402

cli()
