"""The harness's own packages, looked up before anything heavy is imported.

`python -m experiments.run` imports Hydra, OmegaConf, pandas and filelock when runner/main.py
loads, httpx when the jobs are discovered, and scikit-learn or matplotlib only inside a job, after
the model has loaded: a missing one used to be a traceback of 14 to 72 lines, some after minutes of
loading. `check` looks every one up with `importlib.util.find_spec` (which imports nothing) first
and ends the process with one `error:` line naming what is missing and the extra that brings it.
Standard library only: it must run where the harness is not installed.
"""

from __future__ import annotations

import importlib.util
import sys

# import name -> distribution: pyproject.toml's `harness` extra, and pandas and scikit-learn, which the
# library requires but a broken install can lack (tests/runner/test_harness.py)
PACKAGES = {
    "hydra": "hydra-core", "omegaconf": "omegaconf", "filelock": "filelock", "pandas": "pandas",
    "pyarrow": "pyarrow", "matplotlib": "matplotlib", "sklearn": "scikit-learn", "httpx": "httpx",
    "httpx_sse": "httpx-sse", "prometheus_client": "prometheus-client",
}
INSTALL = "pip install -e '.[harness]'"


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
        return True


def missing() -> list[str]:
    """The harness distributions whose module cannot be found, in PACKAGES order."""
    return [dist for module, dist in PACKAGES.items() if _absent(module)]


def check() -> None:
    """Exit with status 2 and one `error:` line when a harness package is missing."""
    gone = missing()
    if gone:
        print(f"error: the harness needs {', '.join(gone)}: {INSTALL}", file=sys.stderr)
        sys.exit(2)
