"""Seam-repair curve: fidelity of a transplanted block as its first K tokens are recomputed.

A block prefilled alone, RoPE-repositioned and spliced after a prefix never saw that prefix;
recomputing its first K tokens against it (seam repair) heals most of the gap. Left: logit cosine
(full vocabulary, last position) against a full recompute, per K: experiment `compose` (skills
items, solid) and the `selfcheck` gate (policy blocks, dashed). Right: top-1 and decision
agreement of the compose runs. Paper Qwen3-8B: 0.9819 (K = 0), 0.9932 (2), 0.9957 (4), 0.9969
(32); Qwen3-1.7B 0.9887 -> 0.9987 at K = 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, reference
from analysis.figures import Skip

NAME = "seam_repair"
TITLE = "Seam repair: transplant fidelity vs recomputed seam tokens K"
NEEDS = "experiment compose and/or experiment selfcheck"


def _paper(ax) -> None:  # noqa: ANN001
    claims = reference()["claims"]
    for model, mk in (("qwen3-8b", "x"), ("qwen3-1.7b", "+")):
        pts = [(int(c.removeprefix("seam_cosine_k")), v["values"][model]) for c, v in claims.items()
               if c.startswith("seam_cosine_k") and model in v["values"]]
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, mk, color=style.PAPER, ms=7, ls=":", lw=0.8,
                label=f"paper {reference()['paper_models'][model]}")


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    comp = frame[(frame["job"] == "compose")] if "job" in frame else frame.iloc[:0]
    comp = comp[comp["kind"] == "fidelity"] if len(comp) and "kind" in comp else comp.iloc[:0]
    sc = frame[(frame["job"] == "selfcheck")] if "job" in frame else frame.iloc[:0]
    if comp.empty and sc.empty:
        raise Skip("no completed run of experiment compose or selfcheck")
    both = pd.concat([comp, sc])
    models = style.models_in(both)
    fig, axes = style.panels(2 if len(comp) else 1, size=(5.2, 3.6))
    ax = axes[0]
    for m in models:
        col = style.colour(m)
        c = comp[comp["model"] == m]
        if len(c):
            t = ci_table(c, "cosine", ["seam"])
            style.band(ax, t, "seam", f"{m} compose ({style.n_range(t)} items)", col)
        s = sc[sc["model"] == m]
        if len(s):
            t = ci_table(s, "cosine", ["seam"], unit=("run_id", "block"))
            style.band(ax, t, "seam", f"{m} selfcheck ({style.n_range(t)} blocks)", col, marker="s", linestyle="--")
    _paper(ax)
    ax.set_xscale("symlog", linthresh=1)
    style.ticks_at(ax, set(both["seam"].dropna()) | {0, 2, 4, 32})
    ax.set_xlabel("seam K (recomputed tokens per block, symlog)")
    ax.set_ylabel("logit cosine vs full recompute")
    ax.set_title("cosine")
    style.legend(ax, loc="lower right")
    if len(comp):
        bx = axes[1]
        ks = sorted(float(k) for k in comp["seam"].dropna().unique())
        series = [(m, value, lab) for m in style.models_in(comp)
                  for value, lab in (("top1_agree", "top-1"), ("decision_agree", "decision"))
                  if value in comp]
        for j, (m, value, lab) in enumerate(series):  # points side by side at each K, not bands
            c = comp[comp["model"] == m]
            t = ci_table(c, value, ["seam"]).sort_values("seam")
            x = np.array([ks.index(float(k)) for k in t["seam"]]) + 0.12 * (j - (len(series) - 1) / 2)
            style.errorbars(bx, x, t, style.colour(m), label=f"{m} {lab} ({style.n_range(t)})",
                            marker="o" if lab == "top-1" else "s")
        bx.set_xticks(range(len(ks)), [f"{k:g}" for k in ks])
        bx.set_ylim(-0.05, 1.05)
        bx.set_xlabel("seam K")
        bx.set_ylabel("agreement with full recompute")
        bx.set_title("top-1 token (o) and decision (s) agreement (compose)")
        style.legend(bx, loc="lower right")
    caption = ("Cosine between the full-vocabulary next-token logits of the composed cache and of a full "
               "prefill of the same tokens. compose: skills items (several skill blocks + a question), n = "
               "items; selfcheck: policy blocks after a prefix, n = blocks. Shaded / bars: 95 % CI. "
               "Grey: paper (its models, GPU).")
    return style.finish(fig, TITLE, caption, out, NAME, both)
