"""Run folders as the runner (runner/rundir.py) lays them out, with synthetic records, for the analysis tests
(tests/analysis) and the figure tests of the experiments (tests/experiments/test_blend.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import yaml

from kvnotes.measure.digests import run_digests

N_ITEMS = 5


def seal(path: Path) -> Path:
    """The digests the runner records in meta.json when a run completes (kvnotes.measure.digests),
    of the files as they are now: call it again after a test edits a fixture run on purpose."""
    meta = json.loads((path / "meta.json").read_text())
    meta["digests"] = run_digests(path, meta)
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def write_run(root: Path, job: str, model: str, stamp: str, rows: list[dict], *, kind: str = "probe",
              task: str = "gated", status: str = "completed", margin: float | None = None,
              params: dict | None = None) -> Path:
    """A run folder as experiments.run writes it: config.yaml, meta.json (digests too), records, summary."""
    path = root / job / model / stamp
    path.mkdir(parents=True)
    section = {"name": job, "margin": margin, **(params or {})}
    cfg = {"model": {"name": model, "margin": 1.0}, "seed": 0, "task": {"name": task, "n_items": N_ITEMS},
           "probe": section if kind == "probe" else None, "experiment": section if kind == "experiment" else None}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    meta = {"kind": kind, "name": job, "model_name": model, "seed": 0, "device": "cpu", "status": status,
            "git": {"commit": "0123456789abcdef", "dirty": False}, "start_time": stamp, "dtype": "float32",
            "model": {"model": model, "hub_id": None, "weights_sha256": "ab" * 32}}
    (path / "meta.json").write_text(json.dumps(meta))
    frame = pd.DataFrame([{"unit": f"u{i}", **r} for i, r in enumerate(rows)])
    frame.to_parquet(path / "records.parquet", index=False)
    (path / "summary.json").write_text(json.dumps({"kind": kind, "name": job, "model": model}))
    return seal(path)
