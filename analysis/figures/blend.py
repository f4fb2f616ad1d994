"""Cache reuse head to head: fidelity against recompute fraction, every method a curve.

Experiment `blend`, per model and workload: the logit cosine against a full prefill (left) and
the task score (right: decision accuracy, or LoCoMo token F1 of a greedy answer) of each method
at each setting, placed at its mean recompute fraction (block tokens recomputed / block tokens;
kvboost: tokens it ran through the model). Curves: seam repair K (= EPIC's LegoLink), CacheBlend
r and note-aware repair r (alone, and with each block's first tokens bought first) at equal
budgets; naive reuse at 0; kvboost as it ships; full prefill at
1 (its task score dashed). Shaded: 95 % CI over items (Wilson for decisions). The caption names
the frontier method at each budget (best mean among methods within it, the cheaper on a tie).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, to_float
from analysis.figures import Skip
from analysis.load import newest_per_workload, select

NAME = "blend"
TITLE = "Cache reuse head to head: fidelity vs recompute fraction"
NEEDS = "experiment blend"
WORKLOADS = ("skills", "memory", "locomo")
CURVES = {  # method column -> label, colour, marker; others (e.g. notes+seam4) get the fallback
    "naive": ("naive reuse", "#7f7f7f", "s"),
    "seam": ("seam repair K = LegoLink", "#1f77b4", "o"),
    "cacheblend": ("CacheBlend r", "#d62728", "^"),
    "attribution": ("attribution r", "#ff7f0e", ">"),
    "query_aware": ("query-aware r (ProphetKV)", "#e377c2", "<"),
    "notes": ("note-aware r", "#2ca02c", "D"),
    "notes+seam2": ("note-aware r, first 2 tokens/block first", "#17becf", "d"),
    "kvboost-selective": ("kvboost selective", "#9467bd", "v"),
    "kvboost-cacheblend": ("kvboost cacheblend", "#8c564b", "P"),
}
FALLBACK = ("#bcbd22", "X")


def curves(methods: list[str]) -> list[tuple[str, str, str, str]]:
    """(method, label, colour, marker) for every method present but full prefill, known ones first."""
    known = [m for m in CURVES if m in methods]
    other = sorted(m for m in methods if m not in CURVES and m != "full")
    return [(m, *CURVES[m]) for m in known] + [(m, m, *FALLBACK) for m in other]
METRICS = (("cosine", "logit cosine vs full prefill"), ("task_score", "task score"))


def frontier_text(d: pd.DataFrame, metric: str, budgets: list[float]) -> str:
    """'5%: seam@2, 15%: ...': the best mean `metric` among methods within each budget."""
    g = d[d["method"] != "full"].groupby("name").agg(x=("recompute_fraction", "mean"), y=(metric, "mean"))
    parts = []
    for b in budgets:
        ok = g[g["x"] <= b + 0.005]  # half a point: budgets round to whole tokens
        if len(ok):
            best = ok.sort_values(["y", "x"], ascending=[False, True]).index[0]
            parts.append(f"{b:.0%}: {best} ({ok.loc[best, 'y']:.3f})")
    return ", ".join(parts)


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "blend")
    df = df[df["kind"] == "blend"] if len(df) and "kind" in df else df.iloc[:0]
    df = newest_per_workload(df)
    if df.empty:
        raise Skip("no completed run of experiment blend")
    df = df.assign(recompute_fraction=to_float(df["recompute_fraction"]), cosine=to_float(df["cosine"]),
                   task_score=to_float(df["task_score"]))
    groups = [(m, w) for m in style.models_in(df) for w in WORKLOADS
              if ((df["model"] == m) & (df["workload"] == w)).any()]
    fig, axes = style.panels(2 * len(groups), ncols=2, size=(4.8, 3.4))
    budgets = sorted({float(s) for s in df.loc[df["method"] == "cacheblend", "setting"]}) or [0.05, 0.15, 0.3]
    lines = []
    for i, (m, w) in enumerate(groups):
        d = df[(df["model"] == m) & (df["workload"] == w)]
        n = d["item_id"].nunique()
        for j, (metric, ylabel) in enumerate(METRICS):
            ax = axes[2 * i + j]
            binary = metric == "task_score" and bool(d[metric].dropna().isin([0.0, 1.0]).all())
            for fam, label, col, mk in curves(list(d["method"].unique())):
                g = d[d["method"] == fam]
                if g.empty:
                    continue
                t = ci_table(g, metric, ["name"], proportion=binary)
                t["x"] = t["name"].map(g.groupby("name")["recompute_fraction"].mean())
                style.band(ax, t, "x", label, col, marker=mk)
            full = d[d["method"] == "full"][metric].mean()
            ax.axhline(full, color="black", ls="--", lw=0.9, label=f"full prefill ({full:.3f})")
            ax.set_xlabel("recompute fraction (of block tokens)")
            ax.set_ylabel(ylabel + (" (F1)" if w == "locomo" and metric == "task_score" else ""))
            ax.set_title(f"{m} · {w} (n={n} items)", fontsize=9)
            style.legend(ax, loc="lower right", fontsize=6)
        lines.append(f"{m} {w} frontier, cosine: {frontier_text(d, 'cosine', budgets)}; "
                     f"task score: {frontier_text(d, 'task_score', budgets)}.")
    caption = ("Each block prefilled alone once and RoPE-moved to where it lands; every method on the "
               "same items and blocks. CacheBlend: top-r % block tokens by key deviation at an early "
               "layer, recomputed against the reused neighbours; note-aware: each block's aggregator "
               "tokens at the same budget. kvboost's fraction counts every token it ran through the "
               "model (its cacheblend re-prefills all cached tokens). Frontier = best mean within each "
               "budget.\n" + "\n".join(lines))
    sel = df[df["method"] == "kvboost-selective"]
    if len(sel) and "cacheblend_forced" in sel and sel["cacheblend_forced"].astype(bool).all():
        caption += ("\nkvboost selective coincides with its cacheblend: chunks warmed alone match only by "
                    "content, and kvboost then forces cacheblend.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
