"""Regenerate every figure of the paper's claims (docs/paper.md) for which runs exist, as PNG and PDF.

    python -m analysis.figures [--results results/reference] [--out results/figures] [--only NAME ...]

Reads every completed run under --results (the newest per job, model, task and seed), draws
each figure that has its runs and says which it skipped and why. Exit status 1 when a figure
failed to draw (a bug, not missing data).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from analysis import load
from analysis.figures import FIGURES, build_all, module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.figures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=Path("results/reference"),
                   help="folder of run directories (default: results/reference)")
    p.add_argument("--out", type=Path, default=Path("results/figures"),
                   help="where the PNG and PDF files go (default: results/figures)")
    p.add_argument("--only", nargs="+", choices=FIGURES, default=None, help="draw only these figures")
    p.add_argument("--list", action="store_true", help="list the figures and the runs each needs")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("analysis").setLevel(logging.DEBUG if a.verbose else logging.WARNING)
    if a.list:
        for name in FIGURES:
            mod = module(name)
            print(f"{name:16s} {mod.TITLE}\n{'':16s} needs: {mod.NEEDS}")
        return 0
    if not a.results.is_dir():
        print(f"error: {a.results} is not a folder of runs (your own runs: --results results/runs)",
              file=sys.stderr)
        return 2
    frame = load.load(a.results)
    n_runs = frame["run_id"].nunique() if len(frame) else 0
    print(f"{n_runs} runs under {a.results}; figures -> {a.out}")
    res = build_all(frame, a.out, a.only)
    for name, paths in res.made.items():
        print(f"  made    {name:16s} {', '.join(str(p) for p in paths)}")
    for name, why in res.skipped.items():
        print(f"  skipped {name:16s} {why}")
    for name, why in res.failed.items():
        print(f"  FAILED  {name:16s} {why}")
    return 1 if res.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
