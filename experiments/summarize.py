"""`python -m experiments.summarize RUN_DIR [...]`: rebuild summary.json from a run's records
(runner/summarize.py, also `python -m runner.summarize`); a missing harness package is one
`error:` line first (runner/harness.py)."""

import sys

from runner import harness

if __name__ == "__main__":
    harness.check()
    from runner.summarize import main

    sys.exit(main())
