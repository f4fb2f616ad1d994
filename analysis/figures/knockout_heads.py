"""Knockout by layer third, where the decision token's attention goes, and its read heads.

Probe `knockout`. (a) Share of items whose decision goes back to the old answer (raw pairwise
decision, over items whose old and new prompts decide differently) with the top 25 % of the
downstream span masked in one third of the layers (paper early 0.00, mid 0.25, late 0.33, all 1.00). (b) Where the decision
token's attention goes (a share; paper field / downstream / sink 0.001 / 0.56 / 0.36). Models side
by side in their colours in both. Then one panel per model: recovery from patching k read heads
ranked by attention to the notes, by their own effect, or at random (paper top-12 0.72-0.82).
The dose-response and the signed reversion: figure `knockout_dose`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, reference, to_float
from analysis.figures import Skip
from analysis.figures.knockout_dose import TASKS, with_variant
from analysis.load import select
from kvnotes.measure.metrics import flipped_back

NAME = "knockout_heads"
TITLE = "Attention knockout: layer thirds, attention of the decision token, read heads"
NEEDS = "probe knockout (task gated)"
BANDS = ("early", "mid", "late", "all")
MASS = ("mass_field", "mass_downstream", "mass_sink", "mass_other", "mass_self")
RANKINGS = (("attention", "#1f77b4", "o", "heads ranked by attention to the notes"),
            ("effect", "#d62728", "^", "heads ranked by their own effect (upper bound)"),
            ("random", "#7f7f7f", "s", "random heads"))


def _offsets(models: list[str]) -> dict[str, float]:
    """Side-by-side x offsets of the models around each category."""
    w = 0.6 / max(len(models), 1)
    return {m: (i - (len(models) - 1) / 2) * w for i, m in enumerate(models)}


def bands_panel(ax, df: pd.DataFrame, models: list[str], claims: dict) -> None:  # noqa: ANN001 - a matplotlib Axes
    off = _offsets(models)
    for m in models:
        d = df[(df["model"] == m) & (df["condition"] == "band") & (df["variant"] == "decision")]
        d = d.assign(flipped=flipped_back(*(to_float(d[c]).to_numpy() for c in ("score", "score_stale", "score_oracle"))))
        b = ci_table(d, "flipped", ["band"], proportion=True).set_index("band").reindex(BANDS).reset_index()
        style.errorbars(ax, np.arange(len(BANDS)) + off[m], b, style.colour(m))
    paper = [claims[f"knockout_{x}"]["values"]["paper"] for x in BANDS]
    ax.plot(np.arange(len(BANDS)), paper, "x", color=style.PAPER, ms=8, mew=1.6)
    ax.set_xticks(range(len(BANDS)), [f"{x} layers" for x in BANDS])
    ax.set_ylim(-0.05, 1.1)
    ax.set_ylabel("share of decisions back to the old answer (Wilson)")


def mass_panel(ax, df: pd.DataFrame, models: list[str]) -> None:  # noqa: ANN001
    mass = df[df["condition"] == "mass"]
    keys = [k for k in MASS if k in df and len(mass)]
    if not keys:
        ax.text(0.5, 0.5, "attention mass not recorded", ha="center", transform=ax.transAxes)
        return
    off = _offsets(models)
    for m in models:
        t = pd.concat([ci_table(mass[mass["model"] == m], k, ["model"]) for k in keys], ignore_index=True)
        if len(t) == len(keys):
            style.errorbars(ax, np.arange(len(keys)) + off[m], t, style.colour(m))
    labels = [k.removeprefix("mass_") for k in keys]
    ref = {"field": 0.001, "downstream": 0.56, "sink": 0.36}
    xs = [j for j, lab in enumerate(labels) if lab in ref]
    ax.plot(xs, [ref[labels[j]] for j in xs], "x", color=style.PAPER, ms=8, mew=1.6)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("share of the decision token's attention")


def heads_panel(ax, d: pd.DataFrame) -> None:  # noqa: ANN001
    h = d[d["condition"] == "heads"]
    if h.empty:  # runs before the head curves: the single top-12 point
        h = d[d["condition"].isin(["heads_top", "heads_random"])]
        h = h.assign(ranking=h["condition"].map({"heads_top": "attention", "heads_random": "random"}))
    if h.empty:
        ax.text(0.5, 0.5, "read heads not run", ha="center", transform=ax.transAxes)
        return
    ns = []
    for rk, col, mk, _ in RANKINGS:
        t = ci_table(h[h["ranking"] == rk], "recovery", ["n_heads"])
        if len(t):
            style.band(ax, t, "n_heads", rk, col, mk)
            ns.append(style.n_range(t))
    ax.vlines(12, 0.72, 0.82, color=style.PAPER, lw=4, alpha=0.5)
    ax.set_xscale("log", base=2)
    style.ticks_at(ax, h["n_heads"])
    ax.axhline(0, color="k", lw=0.6)
    ax.axhline(1, color="k", lw=0.4, ls=":")
    ax.set_xlabel("k heads patched (new -> old)")
    ax.set_ylabel("recovery (95 % bootstrap CI)")
    ax.set_title(ax.get_title() + f" ({', '.join(sorted(set(ns)))})")


def legend_handles(models: list[str]) -> tuple[list[Any], list[str]]:
    # deferred: matplotlib is heavy and only this path needs it
    from matplotlib.lines import Line2D

    handles: list[Any] = [Line2D([], [], color=style.colour(m), marker="o", ls="") for m in models]
    labels = [f"{m} (a, b)" for m in models]
    handles.append(Line2D([], [], color=style.PAPER, marker="x", ls="", ms=8, mew=1.6))
    labels.append("paper (grey; (b): Qwen3-8B; read heads: the bar at k = 12, 0.72-0.82)")
    handles += [Line2D([], [], color=col, marker=mk, lw=1.4) for _, col, mk, _ in RANKINGS]
    labels += [what for *_, what in RANKINGS]
    return handles, labels


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "knockout", TASKS)
    df = df[df["condition"] != "skipped"] if len(df) else df
    if df.empty or not df["condition"].isin(["band", "mass", "heads", "heads_top"]).any():
        raise Skip("no completed run of probe knockout (task gated) with layer thirds, attention mass or heads")
    df = with_variant(df)
    models = style.models_in(df)
    fig, axes = style.panels(2 + len(models), ncols=3, size=(3.6, 3.2))
    bands_panel(axes[0], df, models, reference()["claims"])
    axes[0].set_title("(a) top 25 % masked in one layer third")
    mass_panel(axes[1], df, models)
    axes[1].set_title("(b) attention of the decision token")
    for k, (ax, m) in enumerate(zip(axes[2:], models)):
        ax.set_title(f"({chr(ord('c') + k)}) {m}: read heads")
        heads_panel(ax, df[df["model"] == m])
    caption = ("(a) Masking from the decision token only, in one third of the layers. Shares: 95 % Wilson "
               "intervals over items; attention shares and recoveries: 95 % bootstrap CIs over items "
               "(n per model in the panel titles of the read heads). Read heads: head outputs at the decision "
               "token patched new -> old; the effect ranking is chosen on the same item (an upper bound). "
               "Grey: paper.")
    return style.finish(fig, TITLE, caption, out, NAME, df, legend=legend_handles(models), legend_cols=3)
