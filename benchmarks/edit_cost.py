"""Benchmark: edit time / full re-prefill time, and the per-position map / one prefill, side by side.

Each repetition times, in alternation on the same item, a full prefill of the new prompt and each
edit strategy built from the stale cache (plus, with --map, the whole per-position patching map
of the item). Medians and their ratios are printed; nothing is asserted (machines are noisy).

    python benchmarks/edit_cost.py --model llama --length 2000 --reps 5 [--map]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvnotes import tasks
from kvnotes.edit import Editor
from kvnotes.models import load_model
from kvnotes.patching import make_pair, patched_scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--suite", default="gated")
    p.add_argument("--length", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--map", action="store_true", help="also time the per-position patching map")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    m = load_model(a.model, dtype=a.dtype)
    item = tasks.build_suite(a.suite, m.tokenizer, chat=m.chat, n_items=1, length=a.length, seed=0)[0]
    ed = Editor(m, item)
    ed.full_prefill()  # warm-up
    times: dict[str, list[float]] = {}
    strategies = {"erratum": ed.erratum, "field_erratum": lambda: ed.erratum(with_field=True),
                  "field_only": ed.field_only, "full_downstream": ed.full_downstream}
    for _ in range(a.reps):
        times.setdefault("full_prefill", []).append(ed.full_prefill().seconds)
        for name, fn in strategies.items():
            times.setdefault(name, []).append(fn().seconds)
        if a.map:
            pair = make_pair(m, item)
            t0 = time.perf_counter()
            patched_scores(m, pair, [[q] for q in pair.field_to_end])
            times.setdefault(f"position_map({len(pair.field_to_end)} positions)", []).append(time.perf_counter() - t0)
    base = statistics.median(times["full_prefill"])
    print(f"model={a.model} dtype={m.dtype} tokens={item.n_tokens} reps={a.reps} threads={torch.get_num_threads()}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:40s} median {med * 1000:9.1f} ms   ratio to full prefill {med / base:7.3f}")


if __name__ == "__main__":
    main()
