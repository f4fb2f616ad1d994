"""`python -m experiments.summarize RUN_DIR [...]`: rebuild summary.json from a run's records
(runner/summarize.py, also `python -m runner.summarize`)."""

import sys

from runner.summarize import main

if __name__ == "__main__":
    sys.exit(main())
