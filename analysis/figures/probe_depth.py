"""Probe accuracy by layer, with the write depth and the commit depth.

Probe `linear` on the 2x2 polarity items: a logistic regression reads a label from the residual
stream at the aggregator tokens after the field, cross-validated over templates. One panel per
model and label: `truth` (the correct conclusion) and `model` (the model's own answer). Solid: the
best aggregator (chosen on the same folds: optimistic), with a Wilson band over prompts; dashed:
the mean over aggregators, with a bootstrap band over prompts. Write depth = first relative layer
whose accuracy reaches the threshold (0.9); where none does, the panel says how close it came and
where. Commit depth = relative layer from which the logit lens at the decision token keeps the
final answer, averaged over prompts. The paper: write 0.19-0.39, commit 0.47-0.75.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, layer_accuracy, to_float
from analysis.figures import Skip
from analysis.load import job_params, select

NAME = "probe_depth"
TITLE = "Linear probe accuracy by layer: write depth and commit depth"
NEEDS = "probe linear (task gated-polarity)"
TASKS = ["gated-polarity"]
LABELS = {"truth": "label = correct conclusion", "model": "label = the model's own answer"}


def curves(d: pd.DataFrame, label: str) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(best aggregator curve, mean-over-aggregators curve, where the best sits), as tables with
    rel_layer, mean, lo, hi, n; runs without aggregator rows give their headline layer rows."""
    p = d[(d["condition"] == "probe") & (d["label"] == label)] if "label" in d else d.iloc[:0]
    if p.empty:
        if label != "truth":
            return pd.DataFrame(), pd.DataFrame(), ""
        return layer_accuracy(d[d["condition"] == "layer"]), pd.DataFrame(), "headline token"
    acc = to_float(p["accuracy"])
    best = p.loc[acc.idxmax()] if acc.notna().any() else p.iloc[0]
    b = p[p["aggregator"] == best["aggregator"]].sort_values("layer")
    where = f"aggregator {int(best['aggregator'])} from the last ({best['segment']})"
    m = d[(d["condition"] == "probe_mean") & (d["label"] == label)].sort_values("layer")

    def table(t: pd.DataFrame) -> pd.DataFrame:
        return pd.DataFrame({"rel_layer": to_float(t["rel_layer"]).to_numpy(), "layer": t["layer"].to_numpy(),
                             "mean": to_float(t["accuracy"]).to_numpy(), "lo": to_float(t["ci_lo"]).to_numpy(),
                             "hi": to_float(t["ci_hi"]).to_numpy(), "n": to_float(t["n_prompts"]).to_numpy()})
    return table(b), table(m) if len(m) else pd.DataFrame(), where


def first_reaching(t: pd.DataFrame, thr: float) -> float:
    hit = t[t["mean"] >= thr] if len(t) else t
    return float(hit["rel_layer"].iloc[0]) if len(hit) else float("nan")


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "linear", TASKS)
    if df.empty or not (df["condition"] == "layer").any():
        raise Skip("no completed run of probe linear on task gated-polarity")
    panels = []
    for m in style.models_in(df):
        d = df[df["model"] == m]
        run = str(d["run_id"].iloc[0])
        d = d[d["run_id"] == run]
        for label in LABELS:
            best, mean, where = curves(d, label)
            if len(best) and best["mean"].notna().any():
                panels.append((m, label, d, best, mean, where, float(job_params(frame, run).get("threshold", 0.9))))
    if not panels:
        raise Skip("probe linear ran but no layer accuracy is measurable (one label class or one template)")
    fig, axes = style.panels(len(panels), ncols=min(len(panels), 2), size=(4.6, 3.4))
    for ax, (m, label, d, best, mean, where, thr) in zip(axes, panels):
        col = style.colour(m)
        style.band(ax, best, "rel_layer", f"best: {where} (n={int(best['n'].max())} prompts)", col)
        if len(mean):
            style.band(ax, mean, "rel_layer", "mean over aggregators", col, "s", "--")
        ax.axhline(thr, color="k", lw=0.6, ls=":", label=f"threshold {thr:g}")
        ax.axhline(0.5, color="k", lw=0.4)
        w = first_reaching(best, thr)
        if pd.notna(w):
            ax.axvline(w, color="#2ca02c", lw=1.4, label=f"write depth {w:.2f} (best aggregator)")
        else:
            top = best.loc[best["mean"].idxmax()]
            ax.text(0.02, 0.84, f"never reaches {thr:g}: best {top['mean']:.2f} "
                    f"[{top['lo']:.2f}, {top['hi']:.2f}]\nat relative layer {top['rel_layer']:.2f}: no write depth",
                    fontsize=7, transform=ax.transAxes)
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
        ax.set_title(f"{m}: {LABELS[label]} ({d['item_id'].nunique()} items)")
        ax.set_xlabel("relative depth (layer / (L - 1))")
        ax.set_ylabel("grouped-CV accuracy")
        style.legend(ax, loc="lower right", fontsize=6.5)
    caption = ("Accuracy of a logistic regression reading the label at the aggregator tokens after the field "
               "(folds grouped by template). Solid: the best aggregator (picked on the same folds, so optimistic), "
               "band: 95 % Wilson interval over n prompts; dashed: the mean over aggregators, band: 95 % bootstrap "
               "CI over prompts. Commit depth: mean relative logit-lens commit layer over prompts, band: 95 % "
               "bootstrap CI. Strips at the top: the paper's ranges over its four models.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
