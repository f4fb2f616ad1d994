"""Knockout dose-response: does the decision token read the notes?

Probe `knockout`, one row of panels per model. (a) Dose-response: share of items whose decision
reverts (signed reversion r within [0.5, 1.5]) when the most-attended fraction of the downstream
span is masked, against random sets of the same size, for both mask variants (decision token only;
every query after the notes). (b) The signed reversion of every item for the top 25 % set and its
distance-matched random control: the band [0.5, 1.5] is "reverted", above it overshoots, below 0
moves away. (c) Share reverted with the top 25 % masked in one third of the layers (paper early
0.00, mid 0.25, late 0.33, all 1.00). (d) Where the decision token's attention goes (a share;
paper field / downstream / sink 0.001 / 0.56 / 0.36). (e) Recovery from patching k read heads
ranked by attention to the notes, by their own effect, or at random (paper top-12 0.72-0.82).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import ci_table, reference, to_float, unit_means
from analysis.figures import Skip
from analysis.load import select
from kvnotes.measure.metrics import wilson_ci

NAME = "knockout_dose"
TITLE = "Attention knockout: dose-response, signed reversion, layer thirds, attention mass, read heads"
NEEDS = "probe knockout (task gated)"
TASKS = ["gated"]
BANDS = ("early", "mid", "late", "all")
MASS = ("mass_field", "mass_downstream", "mass_sink", "mass_other", "mass_self")
VARIANTS = {"decision": ("#1f77b4", "decision token only"), "after_notes": ("#d62728", "every query after the notes")}
LO, HI = 0.5, 1.5  # probes.parts.readouts.REVERTED
CLIP = (-3.0, 4.0)  # panel (b) y-range; points beyond are drawn on the edge


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


def dose_panel(ax, d: pd.DataFrame) -> None:  # noqa: ANN001 - a matplotlib Axes
    for v, (col, lab) in VARIANTS.items():
        dv = d[d["variant"] == v]
        for cond, ls, what in (("dose", "-", "most attended"), ("dose_random", "--", "random")):
            t = reverted_share(dv[dv["condition"] == cond], ["fraction"])
            if len(t):
                style.band(ax, t, "fraction", f"{lab}: {what} ({style.n_range(t)})", col,
                           "o" if cond == "dose" else "s", ls)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("fraction of downstream positions masked")
    ax.set_ylabel(f"share of items reverted ({LO:g} <= r <= {HI:g})")
    style.legend(ax, loc="best", fontsize=6.5)


def reversion_panel(ax, d: pd.DataFrame) -> None:  # noqa: ANN001
    rng = np.random.default_rng(0)
    ticks, labels = [], []
    for j, (v, cond) in enumerate((a, b) for a in VARIANTS for b in ("top", "random_matched")):
        per = unit_means(d[(d["variant"] == v) & (d["condition"] == cond)], "reversion", [])
        if per.empty:
            continue
        r = to_float(per["reversion"]).to_numpy()
        col = VARIANTS[v][0] if cond == "top" else style.PAPER
        ax.scatter(j + rng.uniform(-0.18, 0.18, len(r)), np.clip(r, *CLIP), s=9, color=col, alpha=0.7, lw=0)
        ax.hlines(np.median(r), j - 0.3, j + 0.3, color="k", lw=1.4)
        n = len(r)
        ticks.append(j)
        labels.append(f"{'top 25 %' if cond == 'top' else 'random'}\n{v.replace('_', ' ')}\n"
                      f"rev {int(((r >= LO) & (r <= HI)).sum())}/{n}\nover {int((r > HI).sum())}, "
                      f"away {int((r < 0).sum())}")
    ax.axhspan(LO, HI, color="#2ca02c", alpha=0.12, lw=0, label=f"reverted: {LO:g} <= r <= {HI:g}")
    ax.axhline(0, color="k", lw=0.6)
    ax.axhline(1, color="k", lw=0.4, ls=":")
    ax.set_ylim(CLIP[0] - 0.2, CLIP[1] + 0.2)
    ax.set_xticks(ticks, labels, fontsize=6)
    ax.set_ylabel("signed reversion r per item (clipped)")
    style.legend(ax, loc="upper right", fontsize=6.5)


def bands_panel(ax, d: pd.DataFrame, col: str, claims: dict) -> None:  # noqa: ANN001
    b = reverted_share(d[(d["condition"] == "band") & (d["variant"] == "decision")], ["band"])
    b = b.set_index("band").reindex(BANDS).reset_index()
    style.errorbars(ax, np.arange(len(BANDS)), b, col, label=f"ours ({style.n_range(b)})")
    paper = [claims[f"knockout_{x}"]["values"]["paper"] for x in BANDS]
    ax.plot(np.arange(len(BANDS)), paper, "x", color=style.PAPER, ms=7, label="paper")
    ax.set_xticks(range(len(BANDS)), [f"{x} layers" for x in BANDS], fontsize=7.5)
    ax.set_ylim(-0.05, 1.1)
    ax.set_ylabel("share of items reverted")
    style.legend(ax, loc="upper left")


def mass_panel(ax, d: pd.DataFrame, col: str) -> None:  # noqa: ANN001
    mass = d[d["condition"] == "mass"]
    keys = [k for k in MASS if k in d and len(mass)]
    if not keys:
        ax.set_visible(False)
        return
    t = pd.concat([ci_table(mass, k, ["model"]) for k in keys], ignore_index=True)
    labels = [k.removeprefix("mass_") for k in keys]
    style.errorbars(ax, np.arange(len(keys)), t, col, label=f"ours ({style.n_range(t)})")
    ref = {"field": 0.001, "downstream": 0.56, "sink": 0.36}
    xs = [j for j, lab in enumerate(labels) if lab in ref]
    ax.plot(xs, [ref[labels[j]] for j in xs], "x", color=style.PAPER, ms=7, label="paper (Qwen3-8B)")
    ax.set_xticks(range(len(labels)), labels, fontsize=7.5)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("share of the decision token's attention")
    style.legend(ax, loc="upper right")


def heads_panel(ax, d: pd.DataFrame) -> None:  # noqa: ANN001
    h = d[d["condition"] == "heads"]
    if h.empty:  # runs before the head curves: the single top-12 point
        h = d[d["condition"].isin(["heads_top", "heads_random"])]
        h = h.assign(ranking=h["condition"].map({"heads_top": "attention", "heads_random": "random"}))
    if h.empty:
        ax.text(0.5, 0.5, "read heads not run", ha="center", transform=ax.transAxes)
        return
    for rk, col, mk in (("attention", "#1f77b4", "o"), ("effect", "#d62728", "^"), ("random", "#7f7f7f", "s")):
        t = ci_table(h[h["ranking"] == rk], "recovery", ["n_heads"])
        if len(t):
            style.band(ax, t, "n_heads", f"ranked by {rk} ({style.n_range(t)})" if rk != "random"
                       else f"random heads ({style.n_range(t)})", col, mk)
    ax.vlines(12, 0.72, 0.82, color=style.PAPER, lw=4, alpha=0.5, label="paper top-12: 0.72-0.82")
    ax.set_xscale("log", base=2)
    style.ticks_at(ax, h["n_heads"])
    ax.axhline(0, color="k", lw=0.6)
    ax.axhline(1, color="k", lw=0.4, ls=":")
    ax.set_xlabel("k heads patched (new -> old at the decision token)")
    ax.set_ylabel("recovery")
    style.legend(ax, loc="upper left", fontsize=6.5)


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    df = select(frame, "knockout", TASKS)
    df = df[df["condition"] != "skipped"] if len(df) else df
    if df.empty or not (df["condition"] == "dose").any():
        raise Skip("no completed run of probe knockout (task gated) with usable items")
    df = with_variant(df)
    claims = reference()["claims"]
    models = style.models_in(df)
    fig, axes = style.panels(5 * len(models), ncols=5, size=(3.9, 3.4))
    for i, m in enumerate(models):
        d = df[df["model"] == m]
        ax = axes[5 * i: 5 * i + 5]
        dose_panel(ax[0], d)
        reversion_panel(ax[1], d)
        bands_panel(ax[2], d, style.colour(m), claims)
        mass_panel(ax[3], d, style.colour(m))
        heads_panel(ax[4], d)
        for a, t in zip(ax, ("(a) dose-response", "(b) signed reversion, top 25 %", "(c) top 25 % by layer third",
                             "(d) attention of the decision token", "(e) read heads")):
            a.set_title(f"{m}: {t}")
    caption = ("Masking removes chosen cached keys from attention (-inf before the softmax) on the new prompt: "
               "from the decision token only (blue) or from every later query, all layers (red). "
               "r = (oracle - score) / (oracle - stale): 1 = back at the stale decision; reverted = "
               f"{LO:g} <= r <= {HI:g}; over = r > {HI:g} (overshoot); away = r < 0. Random controls: draws "
               "averaged per item; the matched set has the top set's count and distances from the decision "
               "token. Shares: 95 % Wilson intervals over items; attention shares and recoveries: 95 % "
               "bootstrap CIs over items. Read heads: head outputs at the decision token patched new -> old; "
               "the effect ranking is chosen on the same item (an upper bound). Grey: paper.")
    return style.finish(fig, TITLE, caption, out, NAME, df)
