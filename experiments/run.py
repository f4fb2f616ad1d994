"""`python -m experiments.run +probe=<name> | +experiment=<name> model=<name>`: the documented
command line of the runner (runner/main.py, also `python -m runner`). Nothing else lives here;
jobs never import the runner."""

from runner.main import cli

if __name__ == "__main__":
    cli()
