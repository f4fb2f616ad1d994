"""Per-layer recovery: which layers' K/V downstream of the field carry the decision.

Left: probe `patching`, condition `layer`: the new prompt's K/V of one layer, over every position
after the field, patched into the old cache; recovery against relative depth (layer / (L - 1)) so
models of different depth share an axis. Right (when probe `suffix` ran): the same patch over
each third of the layers (early / mid / late) and over all of them. The paper places the notes at
mid layers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import ci_table
from analysis.figures import Skip
from analysis.load import select

NAME = "layer_recovery"
TITLE = "Per-layer recovery of the downstream K/V"
NEEDS = "probe patching with per_layer=true (task gated); layer thirds from probe suffix"
TASKS = ["gated"]
BANDS = ("early", "mid", "late", "all")


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "patching", TASKS)
    df = df[df["condition"] == "layer"] if len(df) else df
    if df.empty:
        raise Skip("no completed run of probe patching (task gated) with per-layer records")
    suf = select(frame, "suffix", TASKS)
    suf = suf[suf["condition"] == "band"] if len(suf) else suf
    models = style.models_in(df)
    fig, axes = style.panels(2 if len(suf) else 1, size=(5.2, 3.4))
    ax = axes[0]
    for m in models:
        t = ci_table(df[df["model"] == m], "recovery", ["rel_layer"])
        n_layers = df.loc[df["model"] == m, "layer"].nunique()
        style.band(ax, t, "rel_layer", f"{m} ({n_layers} layers, {style.n_range(t)})", style.colour(m))
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("relative depth (layer / (L - 1))")
    ax.set_ylabel("recovery (one layer, all downstream positions)")
    ax.set_title("one layer patched")
    style.legend(ax, loc="best")
    if len(suf):
        bx = axes[1]
        sm = style.models_in(suf)
        width = 0.8 / max(len(sm), 1)
        for j, m in enumerate(sm):
            t = ci_table(suf[suf["model"] == m], "recovery", ["band"])
            t = t.set_index("band").reindex(BANDS).reset_index()
            style.errorbars(bx, np.arange(len(BANDS)) + (j - (len(sm) - 1) / 2) * width, t,
                            style.colour(m), label=f"{m} ({style.n_range(t)})")
        bx.set_xticks(range(len(BANDS)), BANDS)
        bx.axhline(0, color="k", lw=0.6)
        bx.set_ylabel("recovery")
        bx.set_title("a third of the layers patched (probe suffix)")
        style.legend(bx, loc="best")
    caption = ("Recovery when only the listed layers' K/V at every position after the field is taken from "
               "the new run. n = usable items per point; shaded / bars: 95 % bootstrap CI over items.")
    return style.finish(fig, TITLE, caption, out, NAME, pd.concat([df, suf]) if len(suf) else df)
