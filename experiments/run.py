"""`python -m experiments.run +probe=<name> | +experiment=<name> model=<name>`: the documented
command line of the runner (runner/main.py, also `python -m runner`). Nothing else lives here;
jobs never import the runner. The harness's packages are looked up first (runner/harness.py), so
a missing one is one `error:` line before Hydra, torch or a model loads."""

from runner import harness

if __name__ == "__main__":
    harness.check()
    from runner.main import cli

    cli()
