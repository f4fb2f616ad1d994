"""Knockout dose-response: does the decision token read the notes?

Probe `knockout`, per model. Left: the share of items whose decision reverts to the old value's
(reversion > 0.5; the mean reversion itself is heavy-tailed) when the decision token's attention
to the most-attended fraction of downstream positions is masked in every layer, with the
same-size random set and the field as controls. Middle: the
share of items reverted (reversion > 0.5) when the top 25 % are masked in one third of the
layers, against the paper (early 0.00, mid 0.25, late 0.33, all 1.00). Right: where the decision
token's attention goes, and recovery from patching the top read heads vs random heads (paper
field / downstream / sink 0.001 / 0.56 / 0.36; top-12 heads 0.72-0.82, random ~0).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, reference
from analysis.figures import Skip
from analysis.load import job_params, select

NAME = "knockout_dose"
TITLE = "Attention knockout: dose-response, layer thirds, attention mass and read heads"
NEEDS = "probe knockout (task gated)"
TASKS = ["gated"]
BANDS = ("early", "mid", "late", "all")
MASS = ("mass_field", "mass_downstream", "mass_sink", "mass_other", "mass_self")


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "knockout", TASKS)
    df = df[df["condition"] != "skipped"] if len(df) else df
    if df.empty or not (df["condition"] == "dose").any():
        raise Skip("no completed run of probe knockout (task gated) with usable items")
    claims = reference()["claims"]
    models = style.models_in(df)
    fig, axes = style.panels(3 * len(models), ncols=3, size=(4.3, 3.2))
    for i, m in enumerate(models):
        d = df[df["model"] == m]
        ax, bx, cx = axes[3 * i: 3 * i + 3]
        col = style.colour(m)
        t = ci_table(d[d["condition"] == "dose"], "reverted", ["fraction"])
        style.band(ax, t, "fraction", f"top-attended masked ({style.n_range(t)})", col)
        top_frac = float(job_params(frame, str(d["run_id"].iloc[0])).get("top_fraction", 0.25))
        for cond, mk, lab in (("random", "s", "random set of the same size"), ("field", "D", "field (x: 0)")):
            c = ci_table(d[d["condition"] == cond], "reverted", ["model"])
            if len(c):
                x = top_frac if cond == "random" else 0.0
                style.errorbars(ax, [x], c, "#7f7f7f" if cond == "random" else "#2ca02c",
                                label=f"{lab} (n={int(c['n'].iloc[0])})", marker=mk)
        ax.axhline(0, color="k", lw=0.6)
        ax.axhline(1, color="k", lw=0.4, ls=":")
        ax.set_xlabel("fraction of downstream positions masked (most attended first)")
        ax.set_ylabel("share of items reverted")
        ax.set_title(f"{m}: dose-response")
        style.legend(ax, loc="best")
        b = ci_table(d[d["condition"] == "band"], "reverted", ["band"]).set_index("band").reindex(BANDS).reset_index()
        style.errorbars(bx, np.arange(len(BANDS)), b, col, label=f"ours ({style.n_range(b)})")
        paper = [claims[f"knockout_{x}"]["values"]["paper"] for x in BANDS]
        bx.plot(np.arange(len(BANDS)), paper, "x", color=style.PAPER, ms=7, label="paper")
        bx.set_xticks(range(len(BANDS)), [f"{x} layers" for x in BANDS], fontsize=7.5)
        bx.set_ylim(-0.05, 1.1)
        bx.set_ylabel("share of items reverted")
        bx.set_title(f"{m}: top 25 % masked by layer third")
        style.legend(bx, loc="upper left")
        mass = d[d["condition"] == "mass"]
        labels, tables = [], []
        for k in MASS:
            if k in d and len(mass):
                labels.append(k.removeprefix("mass_"))
                tables.append(ci_table(mass, k, ["model"]))
        for k, lab in (("heads_top", "top heads"), ("heads_random", "random heads")):
            h = d[d["condition"] == k]
            if len(h):
                labels.append(f"{lab}\n(recovery)")
                tables.append(ci_table(h, "recovery", ["model"]))
        if tables:
            tt = pd.concat(tables, ignore_index=True)
            style.errorbars(cx, np.arange(len(labels)), tt, col, label=f"ours ({style.n_range(tt)})")
            ref = {"field": 0.001, "downstream": 0.56, "sink": 0.36}
            xs = [j for j, lab in enumerate(labels) if lab in ref]
            cx.plot(xs, [ref[labels[j]] for j in xs], "x", color=style.PAPER, ms=7, label="paper (Qwen3-8B)")
            for j, lab in enumerate(labels):
                if lab.startswith("top heads"):
                    cx.vlines(j, 0.72, 0.82, color=style.PAPER, lw=4, alpha=0.5, label="paper top-12 heads")
            cx.set_xticks(range(len(labels)), labels, fontsize=6.5, rotation=30)
        cx.set_ylabel("attention share / recovery")
        cx.set_title(f"{m}: attention mass and read heads")
        style.legend(cx, loc="upper right")
    caption = ("Masking sets the decision token's attention logits to the chosen cached keys to -inf before "
               "the softmax (new prompt's cache). reversion = (oracle - score) / (oracle - stale); reverted = "
               "reversion > 0.5. Attention mass: mean over layers and heads of the decision token's attention. "
               "Read heads: head outputs patched new -> old (random heads: draws averaged per item). n = usable "
               "items; error bars and bands: 95 % bootstrap CI over items. Grey: paper.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
