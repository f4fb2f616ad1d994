"""Selective@K sweep: the field plus its K most important note positions, recomputed or copied.

Experiment `ksweep`, per model: P(correct) (top) and recovery (bottom) against K for each
variant (copy: paste the oracle's K/V, an upper bound; recompute: run those positions against
their stale neighbours, what a real system can do) and ranking (by causal effect, or by the
decision token's attention). K = 0 is the field-only edit.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, to_float
from analysis.figures import Skip
from analysis.load import select

NAME = "ksweep"
TITLE = "Selective@K: field + K note positions"
NEEDS = "experiment ksweep (task gated)"
TASKS = ["gated"]
METRICS = (("correct", "usable_p_correct", "P(correct)"), ("recovery", "usable_recovery", "recovery"))
LINES = {("copy", "effect"): ("#d62728", "-"), ("recompute", "effect"): ("#1f77b4", "-"),
         ("copy", "attention"): ("#d62728", "--"), ("recompute", "attention"): ("#1f77b4", "--")}


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "ksweep", TASKS)
    if df.empty or "k" not in df or df["k"].isna().all():
        raise Skip("no completed run of experiment ksweep (task gated)")
    df = df[df["k"].notna()]
    if not any((to_float(df[u]) > 0).any() for _, u, _ in METRICS):
        raise Skip(f"experiment ksweep ran ({df['item_id'].nunique()} items) but no item is usable "
                   f"for P(correct) or recovery at margin {sorted(set(df['margin'].dropna()))}")
    models = style.models_in(df)
    fig, axes = style.panels(2 * len(models), ncols=len(models), size=(4.6, 3.2))
    for i, m in enumerate(models):
        d = df[df["model"] == m]
        for row, (value, usable, label) in enumerate(METRICS):
            ax = axes[row * len(models) + i]
            u = d[to_float(d[usable]) > 0]
            t = ci_table(u, value, ["variant", "ranking", "k"])
            if t.empty:
                ax.text(0.5, 0.5, f"no item usable for {label}", ha="center", transform=ax.transAxes)
            for (var, rk), g in t.groupby(["variant", "ranking"]):
                col, ls = LINES.get((var, rk), ("#7f7f7f", ":"))
                style.band(ax, g, "k", f"{var} / by {rk} ({style.n_range(g)})", col, linestyle=ls)
            ax.set_xscale("symlog", linthresh=1)
            style.ticks_at(ax, d["k"].dropna())
            ax.axhline(0, color="k", lw=0.4)
            ax.axhline(1, color="k", lw=0.4, ls=":")
            ax.set_xlabel("K (note positions besides the field, symlog)")
            ax.set_ylabel(label)
            ax.set_title(f"{m}: {label} ({style.n_range(t)} usable of {d['item_id'].nunique()} items)")
            style.legend(ax, loc="best")
    caption = ("Selective edit: the field's positions plus the K downstream positions ranked first by "
               "individual causal effect (solid) or by the decision token's attention (dashed); copy pastes "
               "the oracle's K/V there (upper bound), recompute runs them against the stale neighbours. "
               "n = usable items (P(correct): stale and oracle both correct; recovery: |oracle - stale| >= "
               "margin). Shaded: 95 % bootstrap CI over items.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
