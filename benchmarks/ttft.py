"""TTFT benchmark: full prefill vs transplant vs the limit, measured side by side, as ratios.

Not a timed test: absolute seconds depend on the machine and on whatever else runs on it, so
this script runs the three paths alternately in one process (experiments.compose_scaling) and
prints per length the medians, the speedups full/transplant and full/limit, and the fraction of
the limit's speedup the transplant reaches, beside the paper's speedups. The recorded run with
provenance is `python -m experiments.run +experiment=compose_scaling`; this is the quick look.

    python benchmarks/ttft.py --model llama --lengths 512 2048 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from experiments.compose_scaling import ComposeScalingConfig, one_length, summarize  # noqa: E402
from kvnotes.models import load_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seam", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: as is)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    cfg = ComposeScalingConfig(lengths=args.lengths, repeats=args.repeats, seam=args.seam,
                               extra_seams=[0], n_boot=200)
    rows = []
    with tempfile.TemporaryDirectory() as store:
        for n in args.lengths:
            rows += one_length(model, cfg, n, Path(store), chat=model.chat, seed=0)
    out = summarize(rows, cfg)["lengths"]
    print(f"{args.model} {str(model.dtype).removeprefix('torch.')} on {model.device}, "
          f"{torch.get_num_threads()} threads, seam {args.seam}, medians of {args.repeats}")
    print(f"{'L':>6} {'full s':>8} {'transplant s':>12} {'limit s':>8} {'speedup':>8} "
          f"{'limit x':>8} {'of limit':>8} {'paper':>6} {'cosine':>7}")
    for n, r in out.items():
        paper = "" if r["paper_speedup"] is None else f"{r['paper_speedup']:.2f}"
        print(f"{n:>6} {r['full_prefill_s']:8.3f} {r['transplant_s']:12.3f} {r['limit_s']:8.3f} "
              f"{r['speedup']:8.2f} {r['limit_speedup']:8.2f} {r['fraction_of_limit']:8.2f} "
              f"{paper:>6} {r['transplant_cosine']:7.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
