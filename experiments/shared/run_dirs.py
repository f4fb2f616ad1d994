"""Reading another run's directory from a job (the runner's own readers are not for jobs to import)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from kvnotes.measure import runfiles


def run_model_name(path: Path) -> str | None:
    """The model a run directory was run with: meta.json's model_name, else config.yaml's model.name;
    None when neither is readable."""
    try:
        if (path / runfiles.META).is_file():
            return str(json.loads((path / runfiles.META).read_text())["model_name"])
        if (path / runfiles.CONFIG).is_file():
            return str(yaml.safe_load((path / runfiles.CONFIG).read_text())["model"]["name"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    return None
