"""Copy finished runs into the committed reference set (config, meta, records, summary only).

    python -m analysis.reference results/runs/edit/qwen-1.5b/2026-12-02_13-19-44 [RUN_DIR ...] [--to results/reference]

Each run lands at <to>/<job>/<model>/<timestamp>/ with the four files the figures and the report
read; anything else in the run dir (a skill store, logs) stays behind. A run that did not
complete is refused: the reference set holds finished runs only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

FILES = ("config.yaml", "meta.json", "records.parquet", "summary.json")


def copy_run(run_dir: Path, to: Path) -> Path:
    """Copy one completed run's four files to <to>/<job>/<model>/<timestamp>/."""
    run_dir = Path(run_dir)
    missing = [f for f in FILES if not (run_dir / f).is_file()]
    if missing:
        raise ValueError(f"{run_dir}: not a finished run dir, missing {', '.join(missing)}")
    status = json.loads((run_dir / "meta.json").read_text()).get("status")
    if status != "completed":
        raise ValueError(f"{run_dir}: status {status!r}; only completed runs go into the reference set")
    dest = Path(to) / run_dir.parent.parent.name / run_dir.parent.name / run_dir.name
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copy2(run_dir / f, dest / f)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run directories to copy")
    p.add_argument("--to", type=Path, default=Path("results/reference"))
    a = p.parse_args(argv)
    try:
        for run in a.runs:
            print(copy_run(run, a.to))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
