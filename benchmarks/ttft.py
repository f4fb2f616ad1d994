"""TTFT: full prefill vs transplant vs the limit: the `ttft` and `multiblock` workloads of
benchmarks.engine (the recorded run with provenance is `+experiment=compose_scaling`).

    python benchmarks/ttft.py --model llama --lengths 512 2048 --repeats 3 --threads 1

is `python -m benchmarks.engine --only ttft,multiblock --lengths 512,2048 --reps 3 ...`.
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
    p.add_argument("--device", default="auto")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args(argv)
    return engine.main(["--only", "ttft,multiblock", "--model", a.model, "--dtype", a.dtype,
                        "--device", a.device, "--lengths", ",".join(map(str, a.lengths)),
                        "--reps", str(a.repeats), "--threads", str(a.threads)])


if __name__ == "__main__":
    raise SystemExit(main())
