"""Unified edit + compose agent: agreement with full recompute and latency, turn by turn.

Experiment `agent`: skills transplanted into the first context, every later turn only appends
(the previous answer, state changes as errata, the new request). Left: decision agreement with
a full recompute of the prompt with the state rewritten in place, and with a full prefill of the
very same erratum prompt (which isolates the transplant), per turn. Right: latency ratio (full
recompute / composed) per turn. Paper: agreement 0.81-1.00 over 13 models, up to 14.9x lower
latency.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import style
from analysis.aggregate import ci_table
from analysis.figures import Skip

NAME = "agent"
TITLE = "Edit + compose agent: agreement with full recompute and latency per turn"
NEEDS = "experiment agent"
UNIT = ("run_id", "scenario")


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    t = frame[frame["job"] == "agent"] if "job" in frame else frame.iloc[:0]
    t = t[t["kind"] == "turn"] if len(t) and "kind" in t else t.iloc[:0]
    if t.empty:
        raise Skip("no completed run of experiment agent")
    models = style.models_in(t)
    fig, axes = style.panels(2, size=(5.0, 3.5))
    ax, bx = axes
    for m in models:
        d, col = t[t["model"] == m], style.colour(m)
        for value, ls, lab in (("agree", "-", "vs in-place recompute"), ("agree_erratum", "--", "vs same prompt recomputed")):
            tt = ci_table(d, value, ["turn"], unit=UNIT)
            style.band(ax, tt, "turn", f"{m} {lab} ({style.n_range(tt)} scenarios)", col, linestyle=ls)
        tt = ci_table(d, "latency_ratio", ["turn"], unit=UNIT)
        style.band(bx, tt, "turn", f"{m} ({style.n_range(tt)} scenarios)", col)
    for a in (ax, bx):
        style.ticks_at(a, t["turn"].unique())
    ax.axhspan(0.81, 1.0, color=style.PAPER, alpha=0.15, lw=0, label="paper: 0.81-1.00 (13 models)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("turn")
    ax.set_ylabel("decision agreement")
    ax.set_title("agreement with full recompute")
    style.legend(ax, loc="lower left")
    bx.axhline(1, color="k", lw=0.6)
    bx.axhline(14.9, color=style.PAPER, ls="--", lw=1, label="paper: up to 14.9x")
    bx.set_yscale("log")
    bx.set_xlabel("turn")
    bx.set_ylabel("full recompute / composed latency (x, log)")
    bx.set_title("latency ratio")
    style.legend(bx, loc="best")
    caption = ("Turn 0 transplants the skills (seam repair) after the system head; later turns append to the "
               "cache. Agreement = same argmax over the outcome tokens. n = scenarios per turn; shaded: 95 % "
               "bootstrap CI over scenarios.")
    return style.finish(fig, TITLE, caption, out, NAME, t)
