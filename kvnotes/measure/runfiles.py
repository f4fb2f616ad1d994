"""The files of a run directory, named once: every module that reads or writes one says it here.

A run lives in <results>/<job>/<model>/<timestamp>/: its config as composed (`CONFIG`), the
provenance and attempts (`META`), the command lines (`COMMAND`), the log (`LOG`), the overrides
(`OVERRIDES`), one part file per finished unit under `PARTS`, joined into `RECORDS` at the end,
the job's `SUMMARY`, and the lock (`LOCK`, with its holder in `HOLDER`) while a process runs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
META = "meta.json"
COMMAND = "command.txt"
LOG = "run.log"
OVERRIDES = "overrides.yaml"
RECORDS = "records.parquet"
SUMMARY = "summary.json"
PARTS = "parts"
LOCK = ".lock"
HOLDER = ".holder.json"
ALL = (META, CONFIG, COMMAND, LOG, OVERRIDES, RECORDS, SUMMARY, PARTS, LOCK, HOLDER)


def read_json(run_dir: str | Path, name: str) -> dict[str, Any]:
    """A run dir's JSON file (`META` or `SUMMARY`) as a dict; OSError / ValueError when it cannot be read."""
    out = json.loads((Path(run_dir) / name).read_text())
    if not isinstance(out, dict):
        raise ValueError(f"{Path(run_dir) / name} does not hold a JSON object")
    return out
