"""Probe accuracy by layer, with the write depth and the commit depth.

Probe `linear` on the 2x2 polarity items: a logistic regression reads the *conclusion* from the
residual stream at a downstream aggregator token, cross-validated over templates. Write depth =
first relative layer whose accuracy reaches the threshold (0.9); commit depth = relative layer
from which the logit lens at the decision token keeps the final answer, averaged over prompts.
The paper: write 0.19-0.39, commit 0.47-0.75, write before commit in every model.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, layer_accuracy, write_depth
from analysis.figures import Skip
from analysis.load import job_params, select

NAME = "probe_depth"
TITLE = "Linear probe accuracy by layer: write depth and commit depth"
NEEDS = "probe linear (task gated-polarity)"
TASKS = ["gated-polarity"]


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "linear", TASKS)
    if df.empty or not (df["condition"] == "layer").any():
        raise Skip("no completed run of probe linear on task gated-polarity")
    models = style.models_in(df)
    fig, axes = style.panels(len(models), size=(4.6, 3.4))
    for ax, m in zip(axes, models):
        d = df[df["model"] == m]
        run = str(d["run_id"].iloc[0])
        thr = float(job_params(frame, run).get("threshold", 0.9))
        acc = layer_accuracy(d[(d["condition"] == "layer") & (d["run_id"] == run)])
        col = style.colour(m)
        style.band(ax, acc, "rel_layer", f"probe accuracy (n={int(acc['n'].max())} prompts)", col)
        ax.axhline(thr, color="k", lw=0.6, ls=":", label=f"threshold {thr:g}")
        ax.axhline(0.5, color="k", lw=0.4)
        w, w_lo, w_hi = write_depth(acc, thr)
        if pd.notna(w):
            ax.axvline(w, color="#2ca02c", lw=1.4, label=f"write depth {w:.2f}")
            if pd.notna(w_lo) and pd.notna(w_hi):
                ax.axvspan(w_lo, w_hi, color="#2ca02c", alpha=style.CI_ALPHA, lw=0)
        c = ci_table(d[d["condition"] == "prompt"], "rel_commit", ["model"], unit=("run_id", "item_id", "prompt"))
        if len(c) and c["n"].iloc[0] > 0:
            r = c.iloc[0]
            ax.axvline(r["mean"], color="#ff7f0e", lw=1.4, label=f"commit depth {r['mean']:.2f} (n={int(r['n'])})")
            if pd.notna(r["lo"]):
                ax.axvspan(r["lo"], r["hi"], color="#ff7f0e", alpha=style.CI_ALPHA, lw=0)
        ax.axvspan(0.19, 0.39, ymin=0.96, ymax=1.0, color="#2ca02c", alpha=0.5, lw=0, label="paper write 0.19-0.39")
        ax.axvspan(0.47, 0.75, ymin=0.92, ymax=0.96, color="#ff7f0e", alpha=0.5, lw=0, label="paper commit 0.47-0.75")
        ax.set_ylim(0.3, 1.05)
        ax.set_xlim(0, 1)
        ax.set_title(f"{m} ({len(acc)} layers, {d['item_id'].nunique()} items)")
        ax.set_xlabel("relative depth (layer / (L - 1))")
        ax.set_ylabel("grouped-CV accuracy")
        if pd.isna(w):
            ax.text(0.02, 0.8, f"accuracy never reaches {thr:g}:\nno write depth", fontsize=7, transform=ax.transAxes)
        style.legend(ax, loc="lower right")
    caption = ("Accuracy of a logistic regression reading the conclusion at a downstream aggregator token "
               "(folds grouped by template); band: 95 % Wilson interval over n prompts, and the write-depth "
               "band spans the layers where that interval first reaches the threshold. Commit depth: mean "
               "relative logit-lens commit layer over prompts, band: 95 % bootstrap CI. Strips at the top: "
               "the paper's ranges over its four models.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
