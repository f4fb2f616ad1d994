"""Per-position recovery heat strip over the prompt text, and where the notes sit on average.

Left, per model: one item of probe `patching` (the usable item with the largest |oracle - stale|
score gap), each prompt position coloured by the recovery obtained when only that position (all
layers) is patched new -> old (analysis.notes_map.item_map), the field outlined, the ten
strongest tokens labelled. Right: the mean single-position recovery of the field's positions,
of downstream aggregator tokens (punctuation, newlines) and of the other downstream tokens,
averaged within each item first, with CIs over items. The exemplar is also written as a
self-contained HTML notes map next to the figure.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import notes_map, style
from analysis.aggregate import ci_table, to_float
from analysis.figures import Skip
from analysis.load import select

NAME = "position_strip"
TITLE = "Per-position recovery over the prompt (notes map)"
NEEDS = "probe patching with per_position=true (task gated)"
TASKS = ["gated"]
CLASSES = ("field", "downstream aggregator", "downstream other")


def _classes(pos: pd.DataFrame) -> pd.DataFrame:
    in_field = to_float(pos["in_field"]) > 0
    agg = to_float(pos["is_aggregator"]) > 0
    cls = np.where(in_field, CLASSES[0], np.where(agg, CLASSES[1], CLASSES[2]))
    return pos.assign(position_class=cls)


def strongest_apart(rec: np.ndarray, n: int, gap: int) -> list[int]:
    """Positions of the `n` largest recoveries, taken greedily strongest first, each at least
    `gap` positions from those already taken, so that their tick labels do not overprint."""
    taken: list[int] = []
    for p in np.argsort(-np.nan_to_num(rec, nan=-np.inf)):
        if len(taken) == n:
            break
        if all(abs(int(p) - q) >= gap for q in taken):
            taken.append(int(p))
    return sorted(taken)


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "patching", TASKS)
    if df.empty or not (df["condition"] == "tokens").any():
        raise Skip("no completed run of probe patching (task gated) with a per-position map")
    df = df[df["run_id"].isin(df.loc[df["condition"] == "tokens", "run_id"])]
    models = style.models_in(df)
    fig, grid = style.plt.subplots(len(models), 2, figsize=(12, 2.8 * len(models)), squeeze=False,
                                   gridspec_kw={"width_ratios": [3.2, 1]})
    axes = list(grid.ravel())
    out.mkdir(parents=True, exist_ok=True)
    for i, m in enumerate(models):
        d = df[df["model"] == m]
        ax, bx = axes[2 * i], axes[2 * i + 1]
        tok = d[d["condition"] == "tokens"]
        gap = (tok["score_oracle"] - tok["score_stale"]).abs()
        ex = tok.loc[gap.idxmax()]
        one = d[(d["run_id"] == ex["run_id"]) & (d["item_id"] == ex["item_id"])]
        tokens, rec, span, info = notes_map.item_map(one, ex["item_id"])
        stem = f"{NAME}_{m}_" + "".join(c if c.isalnum() else "_" for c in str(ex["item_id"]))
        (out / f"{stem}.html").write_text(notes_map.to_html(tokens, rec, span, info, m))
        vmax = float(np.nanmax(np.abs(rec))) or 1.0
        im = ax.imshow(rec[None], aspect="auto", cmap="RdBu_r", vmin=-vmax, vmax=vmax,
                       interpolation="nearest")
        ax.axvspan(span[0] - 0.5, span[1] - 0.5, fill=False, ec="#2ca02c", lw=1.5, label="field")
        top = strongest_apart(rec, n=10, gap=max(1, len(rec) // 60))
        ax.set_yticks([])
        ax.set_xticks(top, [repr(tokens[p])[1:-1][:8] for p in top], rotation=70, fontsize=6)
        ax.grid(False)
        ax.set_title(f"{m}: item {ex['item_id']} ({info['n_tokens']} tokens; field-only "
                     f"{info['field_only']:.2f}, full-downstream {info['full_downstream']:.2f})", fontsize=8)
        ax.set_xlabel("prompt position (labels: the strongest tokens, one per neighbourhood)")
        fig.colorbar(im, ax=ax, fraction=0.025, pad=0.01, label="recovery")
        style.legend(ax, loc="upper left")
        pos = _classes(d[d["condition"] == "position"])
        t = ci_table(pos, "recovery", ["position_class"])
        t = t.set_index("position_class").reindex(CLASSES).reset_index()
        style.errorbars(bx, np.arange(len(CLASSES)), t, style.colour(m), label=None)
        ticks = [f"{c.replace(' ', chr(10))}\n(n={int(n) if pd.notna(n) else 0})" for c, n in zip(CLASSES, t["n"])]
        bx.set_xticks(range(len(CLASSES)), ticks, fontsize=7)
        bx.set_xlim(-0.5, len(CLASSES) - 0.5)
        bx.axhline(0, color="k", lw=0.6)
        bx.set_ylabel("mean single-position recovery")
        bx.set_title(f"{m}: by position class ({d['item_id'].nunique()} items)")
    caption = ("Left: single-position patch recovery (all layers, new -> old) of one exemplar item per "
               "model (largest score gap); positions before the field are identical in both runs and "
               "drawn at 0. Right: mean over positions of each class within an item, then over items; "
               "error bars: 95 % bootstrap CI over items, n = items with such positions.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
