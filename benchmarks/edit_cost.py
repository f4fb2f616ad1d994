"""Edit time / full re-prefill time, side by side: the `edit` workload of benchmarks.engine.

    python benchmarks/edit_cost.py --model llama --length 2000 --reps 5 [--map]

is `python -m benchmarks.engine --only edit --lengths 2000 ...`; see that module for what is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as benchmarks.engine, before torch loads
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--length", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--map", action="store_true")
    a = p.parse_args(argv)
    args = ["--only", "edit", "--model", a.model, "--dtype", a.dtype, "--lengths", str(a.length),
            "--reps", str(a.reps), "--threads", str(a.threads)]
    return engine.main(args + (["--map"] if a.map else []))


if __name__ == "__main__":
    raise SystemExit(main())
