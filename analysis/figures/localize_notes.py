"""The held-out notes on one prompt's text, coloured by prompt segment.

Experiment `localize`, one panel per model: the prompt of one ranked item (the item whose
smallest held-out set is the median among the items that reach the run's threshold), every token
drawn as its text on a background coloured by its segment (field, session, policy, rule, examples,
request, task, turn markers, answer prefix). The smallest set of positions that recovers the
threshold, ranked on the *other* items of the template (never on this one), is boxed in black with
its rank beside it; when no held-out set reaches the threshold, the top 16 are boxed instead.
Positions before the field are identical in both runs and drawn grey.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.patches import Patch, Rectangle

from analysis import style
from analysis.figures import Skip
from analysis.load import job_params, select
from kvnotes.measure.metrics import smallest_k

NAME = "localize_notes"
TITLE = "Where the notes are: the smallest held-out set that recovers the decision, on one prompt"
NEEDS = "experiment localize (task gated)"
TASKS = ["gated", "gated-fresh"]
WIDTH = 96  # characters per drawn line
FALLBACK_K = 16
RANKED = 16  # ranks written beside the first this many boxed positions only
SEGMENTS = {"field": "#2ca02c", "session": "#98df8a", "policy": "#c7c7c7", "tools": "#dbdb8d",
            "turn_user": "#ff9896", "rule": "#aec7e8", "examples": "#c5b0d5", "request": "#ffbb78",
            "task": "#f7b6d2", "turn_answer": "#ff9896", "answer_prefix": "#9edae5"}
UPSTREAM = "#eeeeee"


def layout(tokens: Sequence[str], width: int = WIDTH) -> list[tuple[int, int, str]]:
    """(row, column, drawn text) of each token, wrapped at `width` characters; a newline token is
    drawn as a return arrow and ends its line."""
    out, row, col = [], 0, 0
    for t in tokens:
        text = t.replace("\n", "\u21b5").replace("\t", " ") or "\u2205"
        if col and col + len(text) > width:
            row, col = row + 1, 0
        out.append((row, col, text))
        col += len(text)
        if "\n" in t:
            row, col = row + 1, 0
    return out


def held_set(rows: pd.DataFrame, threshold: float) -> tuple[float, list[int]]:
    """(k, positions in rank order) of one item's smallest held-out set reaching `threshold`
    (nested sets: each row lists what its k adds); (NaN, top FALLBACK_K) when none reaches it."""
    rows = rows.sort_values("k")
    ks, rec = rows["k"].astype(int).tolist(), rows["recovery"].astype(float).tolist()
    k = smallest_k(ks, rec, threshold)
    stop = k if np.isfinite(k) else FALLBACK_K
    added = [int(p) for kk, a in zip(ks, rows["added"], strict=True) if kk <= stop for p in list(a)]
    return k, added[: int(stop)]


def exemplar(held: pd.DataFrame, threshold: float) -> tuple[str, float, list[int]]:
    """The item whose k is the median among those that reach the threshold (else the first)."""
    sets = {str(i): held_set(g, threshold) for i, g in held.groupby("item_id")}
    reached = sorted((k, i) for i, (k, _) in sets.items() if np.isfinite(k))
    item = reached[len(reached) // 2][1] if reached else sorted(sets)[0]
    return item, *sets[item]


def draw_prompt(ax: Any, tokens: Sequence[str], segments: Sequence[str], chosen: Sequence[int],
                field_start: int) -> None:
    cells = layout(tokens)
    rows = cells[-1][0] + 1 if cells else 1
    rank = {p: r + 1 for r, p in enumerate(chosen)}
    size = min(7.0, ax.figure.get_size_inches()[0] * 0.92 * 72 / (WIDTH * 0.62))
    for p, (row, col, text) in enumerate(cells):
        colour = UPSTREAM if p < field_start else SEGMENTS.get(segments[p], "#ffffff")
        box = p in rank
        ax.add_patch(Rectangle((col, row + 0.05), len(text), 0.9, facecolor=colour, lw=1.4 if box else 0,
                               edgecolor="k" if box else "none"))
        ax.text(col + 0.05, row + 0.52, text, fontsize=size, family="monospace", va="center", ha="left",
                fontweight="bold" if box else "normal", color="#777777" if p < field_start else "k")
        if box and rank[p] <= RANKED:
            ax.text(col, row + 0.02, str(rank[p]), fontsize=size * 0.7, color="#d62728", va="bottom")
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(rows, 0)
    ax.set_axis_off()


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "localize", TASKS)
    if df.empty or not (df["condition"] == "set").any():
        raise Skip("no completed run of experiment localize (task gated)")
    models = style.models_in(df)
    heights = []
    picks: list[dict[str, Any]] = []
    for m in models:
        d = df[df["model"] == m]
        run = str(d["run_id"].iloc[0])
        threshold = float(job_params(frame, run).get("threshold", 0.8))
        held = d[(d["condition"] == "set") & (d["ranking"] == "heldout") & (d["band"] == "all")]
        if held.empty:
            continue
        item, k, chosen = exemplar(held, threshold)
        tok = d[(d["condition"] == "tokens") & (d["item_id"] == item)].iloc[0]
        tokens, segments = list(tok["tokens"]), list(tok["segments"])
        picks.append({"model": m, "item": item, "k": k, "chosen": chosen, "tokens": tokens, "segments": segments,
                      "field_start": int(tok["field_start"]), "threshold": threshold,
                      "n_items": held["item_id"].nunique()})
        heights.append(layout(tokens)[-1][0] + 1)
    if not picks:
        raise Skip("experiment localize ran, but no held-out sets of band all")
    fig, axes = style.plt.subplots(len(picks), 1, figsize=(11, sum(0.15 * h + 0.5 for h in heights)),
                                   squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, p in zip(axes[:, 0], picks, strict=True):
        draw_prompt(ax, p["tokens"], p["segments"], p["chosen"], p["field_start"])
        where = pd.Series([p["segments"][i] for i in p["chosen"]]).value_counts()
        what = (f"smallest held-out set reaching {p['threshold']:g}: k = {int(p['k'])}" if np.isfinite(p["k"])
                else f"no held-out set reaches {p['threshold']:g}; top {FALLBACK_K} shown")
        title = (f"{p['model']}: item {p['item']} ({len(p['tokens'])} tokens; ranked on the other "
                 f"{p['n_items'] - 1} items). {what}; by segment: " + ", ".join(f"{s} {n}" for s, n in where.items()))
        ax.set_title(textwrap.fill(title, 150), fontsize=8, loc="left")
    handles = [Patch(facecolor=c, label=s) for s, c in SEGMENTS.items()]
    handles += [Patch(facecolor=UPSTREAM, label="before the field"),
                Patch(facecolor="white", edgecolor="k", label="held-out set (red: rank)")]
    caption = ("Each token of one prompt, wrapped, on its segment's colour (the segments the item carries; "
               "\u21b5 a newline). Boxed: the positions of the smallest set, ranked by the mean "
               "single-position recovery of the corresponding (segment, offset) positions on the other items "
               "of the suite, that recovers the threshold when patched jointly (all layers, new into old); "
               "the red number is the rank (the first 16). The item is the median one by set size among those that reach it.")
    return style.finish(fig, TITLE, caption, out, NAME, df, legend=(handles, [str(h.get_label()) for h in handles]),
                        legend_cols=7)
