"""Memoization map: recovery when patching the last vs the first k % of the downstream span.

Top row, per model: the suffix and prefix curves of probe `suffix` (k = 2 ... 100 %) with the
field-only recovery of probe `patching` as a horizontal line: if the notes sit at the end of the
prompt, the suffix curve rises early while the prefix curve and the field stay low (paper: suffix
~0.8 by 20 %, prefix ~0.3 until 70 %). Bottom row: top-k positions by individual effect against
random sets of the same size (paper: top-8 0.74-0.79, random-8 <= 0.035). Where the run
recorded it, the prompt segments (session, policy, tools, rule, examples, request, task line) are
shaded along the top row at their mean place in the downstream span, with the share of the top-8
positions each holds: a prefix curve can only rise once it reaches the segments that hold them.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, to_float
from analysis.figures import Skip
from analysis.load import select

NAME = "memoization_map"
TITLE = "Memoization map: suffix vs prefix of the downstream span"
NEEDS = "probe suffix (task gated); the field-only line from probe patching (task gated)"
TASKS = ["gated"]


def segment_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per prompt segment: mean start / end in % of the downstream span and the mean share of the
    top-k positions it holds (items without the segment count 0)."""
    seg = df[df["condition"] == "segment"] if len(df) and "segment" in df else df.iloc[:0]
    if seg.empty:
        return pd.DataFrame(columns=["segment", "start_pct", "end_pct", "top_share"])
    n_items = seg["item_id"].nunique()
    share = to_float(seg["n_top"]) / to_float(seg["top_k"])
    t = seg.assign(share=share).groupby("segment").agg(start_pct=("start_pct", "mean"), end_pct=("end_pct", "mean"),
                                                       top_share=("share", "sum"))
    t["top_share"] = t["top_share"] / n_items
    return t.reset_index().sort_values("start_pct")


def shade_segments(ax, suffix: pd.DataFrame, model: str) -> None:  # noqa: ANN001 - a matplotlib Axes
    t = segment_table(suffix[suffix["model"] == model] if len(suffix) else suffix)
    for j, r in enumerate(t.itertuples()):
        ax.axvspan(r.start_pct, r.end_pct, color="#000000", alpha=0.04 if j % 2 else 0.09, lw=0)
        if r.end_pct - r.start_pct >= 4:
            ax.text((r.start_pct + r.end_pct) / 2, 0.02, f"{r.segment} {r.top_share:.2f}", fontsize=5.5,
                    color="#555555", ha="center", va="bottom", rotation=90, transform=ax.get_xaxis_transform())


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "suffix", TASKS)
    df = df[df["condition"].isin(["suffix", "prefix", "topk", "randomk"])] if len(df) else df
    if df.empty:
        raise Skip("no completed run of probe suffix on task gated with usable items")
    patch = select(frame, "patching", TASKS)
    field = patch[patch["condition"] == "field_only"] if len(patch) else patch
    models = style.models_in(df)
    fig, axes = style.panels(2 * len(models), ncols=len(models), size=(4.0, 3.0))
    notes = []
    for i, m in enumerate(models):
        d = df[df["model"] == m]
        ax, bx = axes[i], axes[len(models) + i]
        t = ci_table(d, "recovery", ["condition", "k"])
        for cond, col, mk in (("suffix", "#d62728", "o"), ("prefix", "#1f77b4", "s")):
            c = t[t["condition"] == cond]
            if len(c):
                style.band(ax, c, "k", f"{cond} ({style.n_range(c)})", col, mk)
        f = ci_table(field[field["model"] == m], "recovery", ["model"]) if len(field) else pd.DataFrame()
        if len(f) and f["n"].iloc[0] > 0:
            r = f.iloc[0]
            ax.axhline(r["mean"], color="#2ca02c", lw=1.2, label=f"field-only (n={int(r['n'])})")
            if pd.notna(r["lo"]):
                ax.axhspan(r["lo"], r["hi"], color="#2ca02c", alpha=style.CI_ALPHA, lw=0)
        else:
            notes.append(f"{m}: no patching run, field-only line absent")
        shade_segments(ax, select(frame, "suffix", TASKS), m)
        style.paper_hline(ax, 0.8, "paper: suffix ~0.8 at 20 %")
        ax.plot([70], [0.3], marker="x", color=style.PAPER, ls="none", label="paper: prefix ~0.3 at 70 %")
        ax.set_title(f"{m}: cumulative patch")
        ax.set_xlabel("k (% of downstream span patched)")
        ax.set_ylabel("recovery")
        style.legend(ax, loc="best")
        for cond, col, mk in (("topk", "#d62728", "o"), ("randomk", "#7f7f7f", "s")):
            c = t[t["condition"] == cond]
            if len(c):
                style.band(bx, c, "k", f"{'top-k by effect' if cond == 'topk' else 'random-k'} ({style.n_range(c)})", col, mk)
        bx.set_xscale("log", base=2)
        bx.axhspan(0.74, 0.79, color=style.PAPER, alpha=0.15, lw=0, label="paper: top-8 0.74-0.79")
        bx.plot([8], [0.035], marker="v", color=style.PAPER, ls="none", label="paper: random-8 <= 0.035")
        bx.set_title(f"{m}: top-k vs random-k positions")
        bx.set_xlabel("k (positions patched, log2)")
        bx.set_ylabel("recovery")
        style.legend(bx, loc="best")
    n_items = df.groupby("model")["item_id"].nunique()
    caption = ("Recovery = (score - stale) / (oracle - stale) when the new prompt's K/V (all layers) "
               "is patched into the old cache over the last (suffix) or first (prefix) k % of the "
               "positions after the field; green: field-only. n = usable items per model: "
               + ", ".join(f"{m} {n_items[m]}" for m in models)
               + ". Shaded: 95 % bootstrap CI over items (random-k: draws averaged per item first). Grey: paper. "
               "Grey columns (top row): prompt segments at their mean place in the downstream span, labelled "
               "with the share of the top-8 positions by individual effect they hold."
               + ("" if not notes else " " + "; ".join(notes) + "."))
    runs = pd.concat([df, field]) if len(field) else df
    return style.finish(fig, TITLE, caption, out, NAME, runs)
