"""Recompute summary.json of finished runs from their records with the current summary code.

    python -m experiments.summarize RUN_DIR [RUN_DIR ...]   (or python -m runner.summarize)

Records are what was measured; a summary is derived from them. When a job's summary gains a
metric (or a bug in one is fixed), this rewrites summary.json from records.parquet and the run's
own config.yaml without re-running a model. The original finish time is kept and the rewrite is
stamped `resummarized`; a run that recorded digests of its files (meta.json `digests`) gets the
new summary.json's digest, so the reference set still takes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from kvnotes.errors import ConfigError
from kvnotes.measure import runfiles
from kvnotes.measure.digests import file_sha256, recorded
from kvnotes.measure.provenance import git_state
from runner.config import validate
from runner.jobs import discover
from runner.main import build_summary
from runner.rundir import now_iso, read_json, summary_table, write_json


def resummarize(run_dir: Path, git: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rewrite one run's summary.json; `git`: the code's state, taken once before a batch writes
    anything (else the first rewritten summary would make the tree dirty for the rest)."""
    run_dir = Path(run_dir)
    for f in (runfiles.CONFIG, runfiles.RECORDS):
        if not (run_dir / f).is_file():
            raise ConfigError(f"{run_dir}: no {f}; only a finished run can be summarised again")
    discover()
    cfg = OmegaConf.load(run_dir / runfiles.CONFIG)
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{run_dir}/config.yaml is not a mapping")
    job = validate(cfg, check_inputs=False)  # the run's inputs were checked when it ran
    old = read_json(run_dir / runfiles.SUMMARY) if (run_dir / runfiles.SUMMARY).is_file() else {}
    summary = build_summary(job, pd.read_parquet(run_dir / runfiles.RECORDS))
    git = git or git_state()  # the code that summarised again (the records keep the run's own commit)
    summary |= {"finished": old.get("finished"), "resummarized": now_iso(),
                "resummarized_commit": git["commit"], "resummarized_dirty": git["dirty"]}
    write_json(run_dir / runfiles.SUMMARY, summary)
    refresh_digest(run_dir, runfiles.SUMMARY)
    return summary


def refresh_digest(run_dir: Path, name: str) -> None:
    """meta.json's digest of `name` after a legitimate rewrite; a run that records no digests
    (finished before runs kept them) is left without (the reference set asks for --force)."""
    path = run_dir / runfiles.META
    meta = read_json(path) if path.is_file() else {}
    if recorded(meta) is not None:
        meta["digests"] = {**meta["digests"], name: file_sha256(run_dir / name)}
        write_json(path, meta)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    a = p.parse_args(argv)
    git = git_state()  # before the first summary.json is rewritten
    for run in a.runs:
        try:
            print(summary_table(resummarize(run, git)))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
