"""Editing frontier: how correct each edit strategy is for what it costs.

Experiment `edit`, per model: each strategy (field-only, selective@K, erratum, CacheBlend, full
downstream, oracle ...) as a point at its mean recompute fraction (recomputed / total tokens) and
its P(correct) (argmax decision equals the oracle's; items where stale and oracle decide
correctly) in the top row, its recovery (items with |oracle - stale| >= margin) in the bottom
row. The line joins the strategies no cheaper strategy beats. Strategies read after a chain of
thought (`+cot`) are drawn hollow. The paper: erratum 1.00 at a small cost, field-only 0.00.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, to_float
from analysis.figures import Skip
from analysis.load import select

NAME = "edit_frontier"
TITLE = "Editing: correctness vs cost per strategy"
NEEDS = "experiment edit (task gated)"
TASKS = ["gated"]
METRICS = (("correct", "usable_p_correct", "P(correct)"), ("recovery", "usable_recovery", "recovery"))


def frontier(points: pd.DataFrame) -> pd.DataFrame:
    """Points not beaten by a cheaper one: sorted by cost, keep each new best."""
    best, keep = -np.inf, []
    for i, r in points.sort_values(["x", "mean"], ascending=[True, False]).iterrows():
        if pd.notna(r["mean"]) and r["mean"] > best:
            best = r["mean"]
            keep.append(i)
    return points.loc[keep].sort_values("x")


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "edit", TASKS)
    if df.empty or "strategy" not in df:
        raise Skip("no completed run of experiment edit (task gated)")
    if not any((to_float(df[u]) > 0).any() for _, u, _ in METRICS):
        raise Skip(f"experiment edit ran ({df['item_id'].nunique()} items) but no item is usable "
                   f"for P(correct) or recovery at margin {sorted(set(df['margin'].dropna()))}")
    models = style.models_in(df)
    fig, axes = style.panels(2 * len(models), ncols=len(models), size=(5.0, 3.6))
    for i, m in enumerate(models):
        d = df[df["model"] == m]
        cot = to_float(d["cot"]) > 0 if "cot" in d else pd.Series(False, index=d.index)
        cost = ci_table(d, "recompute_fraction", ["strategy"])
        for row, (value, usable, label) in enumerate(METRICS):
            ax = axes[row * len(models) + i]
            u = d[to_float(d[usable]) > 0]
            t = ci_table(u, value, ["strategy"]).merge(cost, on="strategy", suffixes=("", "_x"))
            t = t.rename(columns={"mean_x": "x", "lo_x": "x_lo", "hi_x": "x_hi"})
            if t.empty or t["n"].max() == 0:
                ax.text(0.5, 0.5, f"no item usable for {label}", ha="center", transform=ax.transAxes)
            hollow = set(d.loc[cot, "strategy"])
            for j, r in enumerate(t.itertuples()):
                c = style.plt.get_cmap("tab20")(j % 20)
                xerr = [[max(0.0, r.x - r.x_lo) if pd.notna(r.x_lo) else 0], [max(0.0, r.x_hi - r.x) if pd.notna(r.x_hi) else 0]]
                yerr = [[max(0.0, r.mean - r.lo) if pd.notna(r.lo) else 0], [max(0.0, r.hi - r.mean) if pd.notna(r.hi) else 0]]
                ax.errorbar([r.x], [r.mean], xerr=xerr, yerr=yerr, fmt="o", color=c, ms=5, capsize=2,
                            mfc="white" if r.strategy in hollow else c,
                            label=f"{r.strategy} (n={r.n})" if len(models) == 1 else str(r.strategy))
            f = frontier(t[~t["strategy"].isin(hollow)])
            if len(f) > 1:
                ax.plot(f["x"], f["mean"], color="k", lw=0.8, alpha=0.6)
            ax.set_xscale("symlog", linthresh=0.01)
            ax.set_xlim(-0.001, 1.3)
            ax.axhline(0, color="k", lw=0.4)
            ax.axhline(1, color="k", lw=0.4, ls=":")
            ax.set_xlabel("recompute fraction (recomputed / total tokens, symlog)")
            ax.set_ylabel(label)
            ax.set_title(f"{m}: {label} ({style.n_range(t)} usable of {d['item_id'].nunique()} items)")
            if row == 0:
                ax.plot([], [], "x", color=style.PAPER, label="paper: erratum 1.00, field-only 0.00")
            if i == len(models) - 1:
                style.legend(ax, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=6.5)
    caption = ("Each point is one strategy: x = mean recompute fraction, y = P(correct) (top; items where "
               "stale and oracle both decide correctly) or recovery (bottom; items with |oracle - stale| >= "
               "margin); n = usable items, per panel title (range over strategies). Error bars: 95 % bootstrap CI over items. Line: strategies "
               "that no cheaper strategy beats. Hollow: read after a chain of thought.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
