"""Reading another run's directory from a job (the runner's own readers are not for jobs to import)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def run_model_name(path: Path) -> str | None:
    """The model a run directory was run with: meta.json's model_name, else config.yaml's model.name;
    None when neither is readable."""
    try:
        if (path / "meta.json").is_file():
            return str(json.loads((path / "meta.json").read_text())["model_name"])
        if (path / "config.yaml").is_file():
            return str(yaml.safe_load((path / "config.yaml").read_text())["model"]["name"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return None
    return None
