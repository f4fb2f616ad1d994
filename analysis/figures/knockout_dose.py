"""Knockout dose-response: does the decision token read the notes?

Probe `knockout`, every model in one panel per mask variant (decision token only; every query
after the notes). (a) Dose-response: share of items whose decision reverts (signed reversion r
within [0.5, 1.5]) when the most-attended fraction of the downstream span is masked, against
random sets of the same size. (b) The signed reversion of every item for the top 25 % set and its
distance-matched random control: the band [0.5, 1.5] is "reverted", above it overshoots, below 0
moves away. Layer thirds, attention mass and read heads: figure `knockout_heads`. Four panels
(a, b: dose-response; c, d: reversion), one legend below them: readable at page width.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import to_float, unit_means
from analysis.figures import Skip
from analysis.load import select
from kvnotes.measure.metrics import wilson_ci

NAME = "knockout_dose"
TITLE = "Attention knockout: dose-response and signed reversion"
NEEDS = "probe knockout (task gated)"
TASKS = ["gated"]
VARIANTS = {"decision": "decision token only", "after_notes": "every query after the notes"}
LO, HI = 0.5, 1.5  # probes.parts.readouts.REVERTED
CLIP = (-3.0, 4.0)  # panels (c, d) y-range; points beyond are drawn on the edge


def with_variant(df: pd.DataFrame) -> pd.DataFrame:
    """Records of runs before the after_notes variant existed are the decision variant."""
    v = df["variant"] if "variant" in df else pd.Series(np.nan, index=df.index)
    return df.assign(variant=v.fillna("decision"))


def reverted_share(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Per group: share of items reverted with a Wilson CI; an item's draws averaged first."""
    per = unit_means(df, "reversion", by)
    rows = []
    for key, g in per.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        r = to_float(g["reversion"])
        p, lo, hi = wilson_ci(int(((r >= LO) & (r <= HI)).sum()), len(r))
        rows.append({**dict(zip(by, key)), "mean": p, "lo": lo, "hi": hi, "n": len(r)})
    return pd.DataFrame(rows, columns=[*by, "mean", "lo", "hi", "n"])


def dose_panel(ax, d: pd.DataFrame, variant: str, models: list[str]) -> None:  # noqa: ANN001 - a matplotlib Axes
    """Share reverted against the masked fraction: one colour per model, most attended solid with
    its CI band, random sets dashed (their band left out: eight bands would hide the lines)."""
    dv = d[d["variant"] == variant]
    for m in models:
        dm = dv[dv["model"] == m]
        col = style.colour(m)
        for cond, ls, mk in (("dose", "-", "o"), ("dose_random", "--", "s")):
            t = reverted_share(dm[dm["condition"] == cond], ["fraction"])
            if not len(t):
                continue
            if cond == "dose":
                style.band(ax, t, "fraction", f"{m} ({style.n_range(t)})", col, mk, ls)
            else:
                t = t.sort_values("fraction")
                ax.plot(t["fraction"], t["mean"], ls=ls, marker=mk, ms=3, lw=1.1, color=col, alpha=0.8)
    top = max([0.5, *(line.get_ydata().max() for line in ax.get_lines() if len(line.get_ydata()))])
    ax.set_ylim(-0.02, min(1.02, top * 1.25))  # shares, drawn to the data's height (at least 0.5)
    ax.set_xlabel("fraction of downstream positions masked")
    ax.set_ylabel(f"share of items reverted ({LO:g} <= r <= {HI:g})")


def reversion_panel(ax, d: pd.DataFrame, variant: str, models: list[str]) -> None:  # noqa: ANN001
    """Per model: the top 25 % set (the model's colour) beside its matched random set (grey)."""
    rng = np.random.default_rng(0)
    ticks, labels = [], []
    dv = d[d["variant"] == variant]
    for i, m in enumerate(models):
        for j, cond in enumerate(("top", "random_matched")):
            per = unit_means(dv[(dv["model"] == m) & (dv["condition"] == cond)], "reversion", [])
            if per.empty:
                continue
            x = 2.6 * i + j
            r = to_float(per["reversion"]).to_numpy()
            col = style.colour(m) if cond == "top" else style.PAPER
            ax.scatter(x + rng.uniform(-0.2, 0.2, len(r)), np.clip(r, *CLIP), s=7, color=col, alpha=0.7, lw=0)
            ax.hlines(np.median(r), x - 0.35, x + 0.35, color="k", lw=1.4)
            ticks.append(x)
            labels.append(f"{m if cond == 'top' else ''}\n{'top 25%' if cond == 'top' else 'random'}\n"
                          f"rev {int(((r >= LO) & (r <= HI)).sum())}/{len(r)}\nover {int((r > HI).sum())}\n"
                          f"away {int((r < 0).sum())}")
    ax.axhspan(LO, HI, color="#2ca02c", alpha=0.12, lw=0)
    ax.axhline(0, color="k", lw=0.6)
    ax.axhline(1, color="k", lw=0.4, ls=":")
    ax.set_ylim(CLIP[0] - 0.2, CLIP[1] + 0.2)
    ax.set_xticks(ticks, labels, fontsize=6.5)
    ax.set_ylabel("signed reversion r per item (clipped)")


def legend_handles(models: list[str]) -> tuple[list[Any], list[str]]:
    """One entry per model (its colour) and one per line style and band: the figure's legend."""
    # deferred: matplotlib is heavy and only this path needs it
    from matplotlib.lines import Line2D

    # deferred: matplotlib is heavy and only this path needs it
    from matplotlib.patches import Patch

    handles: list[Any] = [Line2D([], [], color=style.colour(m), lw=2) for m in models]
    labels = list(models)
    handles += [Line2D([], [], color="k", ls="-", marker="o", ms=3), Line2D([], [], color="k", ls="--", marker="s", ms=3),
                Patch(color="#2ca02c", alpha=0.25)]
    labels += ["most attended masked (band: 95 % CI)", "random set of the same size",
               f"reverted: {LO:g} <= r <= {HI:g}"]
    return handles, labels


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "knockout", TASKS)
    df = df[df["condition"] != "skipped"] if len(df) else df
    if df.empty or not (df["condition"] == "dose").any():
        raise Skip("no completed run of probe knockout (task gated) with usable items")
    df = with_variant(df)
    models = style.models_in(df)
    fig, axes = style.panels(4, ncols=2, size=(5.2, 3.9))
    for k, v in enumerate(VARIANTS):
        dose_panel(axes[k], df, v, models)
        axes[k].set_title(f"({'ab'[k]}) dose-response: {VARIANTS[v]}")
        reversion_panel(axes[2 + k], df, v, models)
        axes[2 + k].set_title(f"({'cd'[k]}) signed reversion, top 25 %: {VARIANTS[v]}")
    caption = ("Masking removes chosen cached keys from attention (-inf before the softmax) on the new prompt: "
               "from the decision token only (left) or from every later query, all layers (right). "
               "r = (oracle - score) / (oracle - stale): 1 = back at the stale decision; reverted = "
               f"{LO:g} <= r <= {HI:g}; over = r > {HI:g} (overshoot); away = r < 0. Random controls: draws "
               "averaged per item; the matched set (grey) has the top set's count and distances from the decision "
               "token. Shares: 95 % Wilson intervals over items. Layer thirds, attention shares and read heads: "
               "figure knockout_heads.")
    return style.finish(fig, TITLE, caption, out, NAME, df, legend=legend_handles(models))
