"""Editing frontier: how correct each edit strategy is for what it costs.

Experiment `edit`, per model: each strategy (field-only, selective@K, erratum, CacheBlend, full
downstream, oracle ...) as a point at its mean cost (tokens run through the model / total tokens)
and its P(correct) (argmax decision equals the oracle's; items where stale and oracle decide
correctly) or its recovery (items with |oracle - stale| >= margin). The line joins the strategies
no cheaper one beats, among those a real system can run: strategies that need the oracle prefill
(selective_copy pastes its K/V; the effect ranking is measured with it) are drawn apart as stars
and never join the line. A chain-of-thought read (`+cot`, hollow) also pays for the reasoning it
generates. Panels without a usable item are left out. The paper: erratum 1.00, field-only 0.00.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, to_float
from analysis.figures import Skip
from analysis.load import job_params, select
from kvnotes.edit.registry import COT_TOKENS, needs_oracle

NAME = "edit_frontier"
TITLE = "Editing: correctness vs cost per strategy"
NEEDS = "experiment edit (task gated)"
TASKS = ["gated"]
METRICS = (("correct", "usable_p_correct", "P(correct)"), ("recovery", "usable_recovery", "recovery"))


def base_name(strategy: str) -> str:
    return str(strategy).split("+")[0]


def frontier(points: pd.DataFrame) -> pd.DataFrame:
    """Points not beaten by a cheaper one, among those that do not need the oracle."""
    best, keep = -np.inf, []
    ok = points[~points["strategy"].map(needs_oracle)] if len(points) else points
    for i, r in ok.sort_values(["x", "mean"], ascending=[True, False]).iterrows():
        if pd.notna(r["mean"]) and r["mean"] > best:
            best = r["mean"]
            keep.append(i)
    return points.loc[keep].sort_values("x")


def with_cost(d: pd.DataFrame, frame: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Records with `cost`: the recompute fraction, plus the generated reasoning for CoT reads
    (its count when recorded, else the run's cot_tokens budget: an upper bound)."""
    cot = to_float(d["cot"]) > 0 if "cot" in d else pd.Series(False, index=d.index)
    cost = to_float(d["recompute_fraction"])
    note = ""
    if cot.any():
        if "generated_tokens" in d:
            gen = to_float(d["generated_tokens"])
        else:
            budget = {r: float(job_params(frame, r).get("cot_tokens", COT_TOKENS)) for r in d.loc[cot, "run_id"].unique()}
            gen = d["run_id"].map(budget).astype(float)
            note = " CoT cost uses the run's cot_tokens budget (records lack the generated count): an upper bound."
        cost = cost.where(~cot, cost + gen / to_float(d["n_tokens"]))
    return d.assign(cost=cost, is_cot=cot), note


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "edit", TASKS)
    if df.empty or "strategy" not in df:
        raise Skip("no completed run of experiment edit (task gated)")
    panels = [(m, metric) for m in style.models_in(df) for metric in METRICS
              if (to_float(df.loc[df["model"] == m, metric[1]]) > 0).any()]
    if not panels:
        raise Skip(f"experiment edit ran ({df['item_id'].nunique()} items) but no item is usable "
                   f"for P(correct) or recovery at margin {sorted(set(df['margin'].dropna()))}")
    df, cost_note = with_cost(df, frame)
    names = sorted({base_name(s) for s in df["strategy"]})
    colours = {s: style.plt.get_cmap("tab20")(j % 20) for j, s in enumerate(names)}
    fig, axes = style.panels(len(panels), ncols=min(len(panels), 2), size=(5.0, 3.6))
    handles: dict[str, Any] = {}
    for ax, (m, (value, usable, label)) in zip(axes, panels):
        d = df[df["model"] == m]
        cost = ci_table(d, "cost", ["strategy"])
        u = d[to_float(d[usable]) > 0]
        t = ci_table(u, value, ["strategy"]).merge(cost, on="strategy", suffixes=("", "_x"))
        t = t.rename(columns={"mean_x": "x", "lo_x": "x_lo", "hi_x": "x_hi"})
        hollow = set(d.loc[d["is_cot"], "strategy"])
        for r in t.itertuples():
            oracle = needs_oracle(r.strategy)
            c = colours[base_name(r.strategy)]
            xerr = [[max(0.0, r.x - r.x_lo) if pd.notna(r.x_lo) else 0], [max(0.0, r.x_hi - r.x) if pd.notna(r.x_hi) else 0]]
            yerr = [[max(0.0, r.mean - r.lo) if pd.notna(r.lo) else 0], [max(0.0, r.hi - r.mean) if pd.notna(r.hi) else 0]]
            point = ax.errorbar([r.x], [r.mean], xerr=xerr, yerr=yerr, fmt="*" if oracle else "o", color=c,
                                ms=9 if oracle else 5, capsize=2, mfc="white" if r.strategy in hollow else c)
            lab = str(r.strategy) + (" (needs the oracle)" if oracle else "") + (" (hollow: CoT)" if r.strategy in hollow else "")
            handles.setdefault(lab, point)
        f = frontier(t)
        if len(f) > 1:
            line = ax.plot(f["x"], f["mean"], color="k", lw=0.8, alpha=0.6)[0]
            handles.setdefault("frontier (strategies that need no oracle)", line)
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlim(-0.001, max(1.3, float(np.nanmax(t["x"])) * 1.1) if len(t) else 1.3)
        ax.axhline(0, color="k", lw=0.4)
        ax.axhline(1, color="k", lw=0.4, ls=":")
        ax.set_xlabel("cost: tokens run / total tokens (symlog)")
        ax.set_ylabel(label)
        ax.set_title(f"{m}: {label} ({style.n_range(t)} usable of {d['item_id'].nunique()} items)")
    axes[-1].legend(list(handles.values()), list(handles.keys()), loc="center left", bbox_to_anchor=(1.0, 0.5),
                    fontsize=6.5, frameon=False)
    caption = ("Each point is one strategy: x = mean cost (recomputed tokens / total tokens; CoT reads add their "
               "generated reasoning), y = P(correct) (items where stale and oracle both decide correctly) or "
               "recovery (items with |oracle - stale| >= margin); n = usable items, per panel title (range over "
               "strategies). Error bars: 95 % bootstrap CI over items. Line: strategies that no cheaper one beats "
               "among those that need no oracle; stars need the oracle prefill (selective_copy, effect ranking) "
               "and are upper bounds, not deployable. Hollow: read after a chain of thought. Panels with no "
               "usable item are left out. Paper: erratum 1.00, field-only 0.00." + cost_note)
    return style.finish(fig, TITLE, caption, out, NAME, df)
