"""Field after the rule, filler downstream: recovery by field-to-decision distance.

Experiment `distance`, one line per model against the distance d (tokens from the last field
token to the decision token, log scale): mean |score_new - score_old| over all items, the share
of items usable at the run's margin (Wilson interval), and over usable items the field-only and
notes-only recoveries (bootstrap CIs over items). Field-only near 1 means the decision reads the
field itself; notes-only near 1 (field-only ~ 0) means it reads the notes after the field.
Recovery panels are left out when no model has a usable item.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, to_float
from analysis.figures import Skip
from analysis.load import select
from kvnotes.measure.metrics import wilson_ci

NAME = "distance"
TITLE = "Field after the rule, filler downstream, by distance: |delta score|, usable share, field-only and notes-only recovery"
NEEDS = "experiment distance (task gated, else gated-fresh)"
TASKS = ["gated", "gated-fresh"]
RECOVERIES = (("field_only", "field-only recovery"), ("notes_only", "notes-only recovery"))


def usable_share(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and distance: share of items usable (mean, lo, hi: Wilson 95 %) and n items."""
    rows = []
    for (model, d), g in df.groupby(["model", "distance"], sort=True):
        per_item = g.groupby(["run_id", "item_id"])["_usable"].max()
        p, lo, hi = wilson_ci(int(per_item.sum()), int(per_item.size))
        rows.append({"model": model, "distance": d, "mean": p, "lo": lo, "hi": hi, "n": int(per_item.size)})
    return pd.DataFrame(rows, columns=["model", "distance", "mean", "lo", "hi", "n"])


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "distance", TASKS)
    if df.empty or "distance" not in df or df["distance"].isna().all():
        raise Skip("no completed run of experiment distance (task gated or gated-fresh)")
    df = df[df["distance"].notna()].assign(distance=lambda d: to_float(d["distance"]))
    df = df.assign(_usable=to_float(df["usable"]) > 0)
    usable = df[df["_usable"]]
    models = style.models_in(df)
    panels = [("abs_delta", "mean |score_new - score_old| (logits)"), ("usable", "usable share")]
    panels += list(RECOVERIES) if len(usable) else []
    fig, axes = style.panels(len(panels), ncols=min(len(panels), 4), size=(3.6, 3.0))
    tables = {"abs_delta": ci_table(df, "abs_delta", ["model", "distance"]), "usable": usable_share(df)}
    tables |= {c: ci_table(usable, c, ["model", "distance"]) for c, _ in RECOVERIES if len(usable)}
    for ax, (key, label) in zip(axes, panels, strict=True):
        t = tables[key]
        for m in models:
            g = t[t["model"] == m]
            if len(g):
                task = df.loc[df["model"] == m, "task"].iloc[0]
                style.band(ax, g, "distance", f"{m} [{task}] ({style.n_range(g)})", style.colour(m, models))
        ax.set_xscale("log", base=2)
        style.ticks_at(ax, df["distance"])
        if key != "abs_delta":
            ax.axhline(0, color="k", lw=0.4)
            ax.axhline(1, color="k", lw=0.4, ls=":")
        ax.set_xlabel("distance d (tokens, log scale)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} ({style.n_range(t)} per point)")
        style.legend(ax, loc="best")
    margins = sorted({float(v) for v in to_float(df.get("margin_record", df.get("margin", pd.Series(dtype=float)))).dropna()})
    n_items = df.groupby("model")["pair_id" if "pair_id" in df else "item_id"].nunique().to_dict()
    caption = (
        "Each item is rendered at every distance d (tokens from the last field token to the decision token; "
        "the plotted d is the target, the rendered one lies within ~10 tokens of it), with the same draws and "
        "total length at every d: only the field's session block moves. |delta| over all items (bootstrap "
        "95 % CI); usable share = |delta| >= margin "
        f"{', '.join(f'{m:g}' for m in margins) or '?'} (Wilson 95 % interval); field-only (the field's K/V "
        "from the new run) and notes-only (every position after the field from the new run, the field stale) "
        "recovery over usable items (bootstrap 95 % CI over items). n in the legend = items per point; "
        "items per model (each at every d): " + ", ".join(f"{m} {n}" for m, n in n_items.items()) + "."
        + ("" if len(usable) else " No item is usable at any distance: recovery panels left out.")
    )
    return style.finish(fig, TITLE, caption, out, NAME, df)
