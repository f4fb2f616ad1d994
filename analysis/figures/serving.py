"""Serving: TTFT distribution and prefix-cache hit rate, erratum vs in-prefix edit.

Experiment `serving` (a vLLM server with automatic prefix caching, Poisson arrivals): because an
erratum is appended, the prompt prefix stays byte-identical and the prefix cache keeps hitting;
an in-prefix edit changes the prefix and misses. Left, per model: the empirical CDF of TTFT per
arm and request rate (log x). Right: prefix-cache hit rate per arm. Paper (vLLM, Qwen3-8B,
8,066-token prompt): hit rate 0.985 vs 0.010; p90 TTFT 53-398x lower. The record columns are
matched by name (analysis.aggregate.serving_view).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import serving_view
from analysis.figures import Skip

NAME = "serving"
TITLE = "Serving: TTFT CDF and prefix-cache hit rate, erratum vs in-prefix edit"
NEEDS = "experiment serving"
ARMS = {"erratum": "#1f77b4", "edit": "#d62728", "edit_field": "#ff7f0e", "hoist": "#2ca02c"}
PAPER_HIT = {"erratum": 0.985, "edit": 0.010}


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    v, why = serving_view(frame)
    if why:
        raise Skip(why)
    if v["ttft_ms"].notna().sum() == 0:
        raise Skip("serving run has no request with a TTFT")
    models = style.models_in(v)
    fig, axes = style.panels(2 * len(models), ncols=2, size=(5.6, 4.6))
    for i, m in enumerate(models):
        d = v[v["model"] == m]
        ax, bx = axes[2 * i], axes[2 * i + 1]
        phases = list(dict.fromkeys(d.sort_values("rate", na_position="first")["phase_label"]))
        dashes = ["-", "--", ":", "-."]
        for arm, g in d.groupby("arm"):
            for j, ph in enumerate(phases):
                r = g[g["phase_label"] == ph].dropna(subset=["ttft_ms"])
                if r.empty:
                    continue
                x = np.sort(r["ttft_ms"].to_numpy())
                cens = int(r["censored"].sum())
                lab = (f"{arm}, {ph} (n={len(x)}, p90 {np.quantile(x, 0.9):.0f} ms"
                       + (f", {cens} censored" if cens else "") + ")")
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=ARMS.get(str(arm), "#7f7f7f"),
                        ls=dashes[j % len(dashes)], label=lab)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.axhline(0.9, color="k", lw=0.4, ls=":")
        ax.set_xlabel("time to first token (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{m}: TTFT CDF")
        style.legend(ax, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=6)
        hits = d.drop_duplicates(["run_id", "arm", "phase_label"])
        for k, (arm, g) in enumerate(hits.groupby("arm")):
            xs = [phases.index(p) + (k - 1) * 0.08 for p in g["phase_label"]]
            bx.plot(xs, g["hit"], "o", color=ARMS.get(str(arm), "#7f7f7f"), label=f"{arm}")
            if arm in PAPER_HIT:
                bx.axhline(PAPER_HIT[arm], color=ARMS[arm], ls="--", lw=0.8, alpha=0.6,
                           label=f"paper {arm} {PAPER_HIT[arm]:g} (vLLM, Qwen3-8B)")
        bx.set_xticks(range(len(phases)), phases)
        bx.set_xlim(-0.5, len(phases) - 0.5)
        bx.set_ylim(-0.05, 1.05)
        bx.set_ylabel("prefix-cache hit rate (per phase)")
        bx.set_title(f"{m}: prefix-cache hit rate")
        style.legend(bx, loc="center right", fontsize=6.5)
    caption = ("Left: empirical CDF of client TTFT per request, per prompt variant (edit: state rewritten in the "
               "prefix, a new request id each time; edit_field: only the field rewritten; erratum: appended; "
               "hoist: field moved before the request) and phase (sequential, rates the edit sustains, overload); "
               "requests still open at the overload cap are censored: their TTFT is a lower bound, so a censored "
               "quantile is too. "
               "n = requests. Right: prefix-cache hit rate of each phase (vLLM counters: hit / queried tokens "
               "over the phase; one ratio per phase, so no sampling CI). Dashed: paper (another model and machine).")
    runs = frame[frame["job"] == "serving"]
    return style.finish(fig, TITLE, caption, out, NAME, runs)
