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


REFERENCE = ("stale", "oracle")  # 0 and 1 of recovery by definition: one black legend entry
YCLIP = {"recovery": (-1.0, 2.0), "correct": (-0.05, 1.08)}  # the informative range of each metric
MAX_COLOURS = 8  # legend entries: distinct colours beyond this are not told apart on a page


def colours_for(strategies: list[str]) -> dict[str, Any]:
    """A colour per base strategy: black for stale and oracle, grey for those that need the oracle
    (stars, labelled on the plot), distinct tab10 colours for the deployable ones."""
    out: dict[str, Any] = {}
    deployable = [s for s in sorted({base_name(s) for s in strategies})
                  if s not in REFERENCE and not needs_oracle(s)]
    for j, s in enumerate(deployable):
        out[s] = style.plt.get_cmap("tab10")(j % 10)
    for s in strategies:
        b = base_name(s)
        out.setdefault(b, "black" if b in REFERENCE else style.PAPER)
    return out


def _bar(v: float, lo: float, hi: float, clip: tuple[float, float]) -> tuple[float, list[list[float]]]:
    """The point's y on the axis (clipped) and its error bar, cut at the axis' edges."""
    y = min(max(v, clip[0]), clip[1])
    lo = y if pd.isna(lo) else max(min(lo, clip[1]), clip[0])
    hi = y if pd.isna(hi) else max(min(hi, clip[1]), clip[0])
    return y, [[max(0.0, y - lo)], [max(0.0, hi - y)]]


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
    colours = colours_for(list(df["strategy"].unique()))
    fig, axes = style.panels(len(panels), ncols=min(len(panels), 2), size=(5.0, 3.8))
    handles: dict[str, Any] = {}
    for ax, (m, (value, usable, label)) in zip(axes, panels):
        d = df[df["model"] == m]
        cost = ci_table(d, "cost", ["strategy"])
        u = d[to_float(d[usable]) > 0]
        t = ci_table(u, value, ["strategy"]).merge(cost, on="strategy", suffixes=("", "_x"))
        t = t.rename(columns={"mean_x": "x", "lo_x": "x_lo", "hi_x": "x_hi"})
        hollow = set(d.loc[d["is_cot"], "strategy"])
        clip = YCLIP[value]
        n_off = 0
        for r in t.itertuples():
            oracle, base = needs_oracle(r.strategy), base_name(r.strategy)
            c = colours[base]
            y, yerr = _bar(r.mean, r.lo, r.hi, clip)
            off = not clip[0] <= r.mean <= clip[1]
            xerr = [[max(0.0, r.x - r.x_lo) if pd.notna(r.x_lo) else 0], [max(0.0, r.x_hi - r.x) if pd.notna(r.x_hi) else 0]]
            fmt = ("^" if r.mean > clip[1] else "v") if off else ("*" if oracle else "o")
            point = ax.errorbar([r.x], [y], xerr=xerr, yerr=yerr, fmt=fmt, color=c, ms=9 if oracle else 5.5,
                                capsize=2, mfc="white" if r.strategy in hollow else c, lw=1.1)
            if off:  # the value beside its marker on the edge, stacked away from the edge
                ax.annotate(f"{r.strategy}: {r.mean:.1f} [{r.lo:.1f}, {r.hi:.1f}]", (r.x, y),
                            xytext=(6, (-10 - 9 * n_off) if y > 0 else (4 + 9 * n_off)),
                            textcoords="offset points", fontsize=6.5, color=c)
                n_off += 1
            elif oracle:  # grey stars: named on the plot, not in the legend
                ax.annotate(str(r.strategy), (r.x, y), xytext=(-6, 5), textcoords="offset points",
                            fontsize=6.5, color="#555555", ha="right")
            elif base in REFERENCE:
                handles.setdefault("stale (cost 0) and oracle (cost 1): the references", point)
            else:
                handles.setdefault(base, point)
        f = frontier(t)
        if len(f) > 1:
            ax.plot(f["x"], f["mean"].clip(*clip), color="k", lw=0.8, alpha=0.6)
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlim(-0.001, max(1.3, float(np.nanmax(t["x"])) * 1.1) if len(t) else 1.3)
        pad = 0.04 * (clip[1] - clip[0])  # room for the edge markers
        ax.set_ylim(clip[0] - pad, clip[1] + pad)
        ax.axhline(0, color="k", lw=0.4)
        ax.axhline(1, color="k", lw=0.4, ls=":")
        ax.set_xlabel("cost: tokens run / total tokens (symlog)")
        ax.set_ylabel(label + (f" (axis {clip[0]:g} to {clip[1]:g})" if value == "recovery" else ""))
        ax.set_title(f"{m}: {label} ({style.n_range(t)} usable of {d['item_id'].nunique()} items)")
    names = sorted(handles, key=lambda k: (k.startswith("stale"), k))
    caption = ("Each point is one strategy: x = mean cost (recomputed tokens / total tokens; CoT reads add their "
               "generated reasoning), y = P(correct) (items where stale and oracle both decide correctly) or "
               "recovery (items with |oracle - stale| >= margin); n = usable items, per panel title (range over "
               "strategies). Error bars: 95 % bootstrap CI over items. Recovery is drawn from -1 to 2, its "
               "informative range (0 = stale, 1 = oracle): a mean beyond it is a triangle on the edge with its "
               "value and CI written beside it, and bars are cut at the edge (they ran from -2 to 9 and "
               "squashed the rest). Line: strategies that no cheaper one beats among those that need no "
               "oracle. Grey stars, named on the plot, need the oracle prefill (selective_copy, effect ranking): "
               "upper bounds, not deployable. Hollow: read after a chain of thought (same colour as the "
               "strategy). Panels with no usable item are left out. Paper: erratum 1.00, field-only 0.00."
               + cost_note)
    return style.finish(fig, TITLE, caption, out, NAME, df, legend=([handles[k] for k in names], names),
                        legend_cols=4)
