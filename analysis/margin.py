"""Derive a model's usability margin from a validate_tasks run on the control suite.

    python -m experiments.run +experiment=validate_tasks model=llama task=gated-control task.n_items=48
    python -m analysis.margin results/runs/validate_tasks/llama/<timestamp> [...]

Reads score_new - score_old of every control item (request_id or current_time changed; the
correct action must not) and applies the rule of kvnotes.measure.margins, fixed in advance:
margin = max(3 x RMS of those shifts, 8 score steps of the run's dtype), rounded up to 0.01.
Prints the margin with what it came from, and the lines to put in configs/model/<name>.yaml and
kvnotes/measure/margins.py. A run that is not a completed validate_tasks run of gated-control is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import yaml

from kvnotes.measure import runfiles
from kvnotes.measure.margins import RULE, Derivation, derive

CONTROL_SUITE = "gated-control"


def from_run(run_dir: Path) -> tuple[str, Derivation]:
    """(model, derivation) of one completed validate_tasks run on the control suite."""
    run_dir = Path(run_dir)
    for f in (runfiles.CONFIG, runfiles.META, runfiles.RECORDS):
        if not (run_dir / f).is_file():
            raise ValueError(f"{run_dir}: no {f}; pass a completed validate_tasks run dir")
    cfg = yaml.safe_load((run_dir / runfiles.CONFIG).read_text()) or {}
    meta = json.loads((run_dir / runfiles.META).read_text())
    job = (cfg.get("experiment") or {}).get("name")
    suite = (cfg.get("task") or {}).get("name")
    if job != "validate_tasks" or suite != CONTROL_SUITE:
        raise ValueError(f"{run_dir}: a {job} run on task {suite}; the rule reads validate_tasks on {CONTROL_SUITE}")
    if meta.get("status") != "completed":
        raise ValueError(f"{run_dir}: status {meta.get('status')!r}; only a completed run gives a margin")
    rec = pd.read_parquet(run_dir / runfiles.RECORDS)
    deltas = pd.to_numeric(rec["score_new"], errors="coerce") - pd.to_numeric(rec["score_old"], errors="coerce")
    task = cfg.get("task") or {}
    git = meta.get("git") or {}
    commit = str(git.get("commit") or "?")[:7] + ("" if git.get("dirty") is False else ", dirty tree")
    source = (f"validate_tasks {CONTROL_SUITE}, {task.get('length')} tokens, seed {meta.get('seed')}, "
              f"commit {commit}")
    return str(meta.get("model_name")), derive(deltas.to_numpy(), str(meta.get("dtype", "float32")), source)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.margin", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="validate_tasks run dirs on task gated-control")
    a = p.parse_args(argv)
    try:
        found = [from_run(r) for r in a.runs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"rule: {RULE}")
    for model, d in found:
        print(f"{model} ({d.dtype}): margin {d.margin:g}  (control RMS {d.rms:.4g} over {d.n_control} items; {d.source})")
        print(f"  configs/model/{model}.yaml:  margin: {d.margin:g}")
        print(f'  kvnotes/measure/margins.py DERIVED:  "{model}": Derivation(margin={d.margin:g}, rms={d.rms:.4g}, '
              f'n_control={d.n_control}, dtype="{d.dtype}", source="{d.source}"),')
    return 0


if __name__ == "__main__":
    sys.exit(main())
