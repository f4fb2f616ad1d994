"""Time to first token against skill length: full prefill vs transplant vs the limit.

Experiment `compose_scaling`: for each skill length the three paths are timed side by side in
one process (order rotated every repeat): full prefill of prefix + skill + question; transplant
(load the stored block, rotate it into place, recompute the seam, prefill the question); and the
limit (the question alone against an already cached context; where a run timed it more than one
way: through transformers alone, through kvnotes' extend, and over a cache held in place with no
copy, the fastest of them). Left: TTFT per path (log-log).
Right: speedup full / transplant and full / limit, paired per repeat, against the paper's
Qwen3-8B GPU numbers (1.16x at 500 tokens ... 13.93x at 32k).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis import style
from analysis.aggregate import reference
from analysis.figures import Skip
from analysis.load import job_params
from kvnotes.measure.metrics import range_dict

NAME = "ttft_scaling"
TITLE = "TTFT vs skill length: full prefill, transplant, limit"
NEEDS = "experiment compose_scaling"
PATHS = (("full", "#d62728", "full prefill"), ("transplant", "#1f77b4", "transplant"),
         ("limit", "#2ca02c", "limit: question only"))


def speedups(t: pd.DataFrame, seam: int) -> pd.DataFrame:
    """Per length: paired per-repeat ratios full / transplant@seam and full / limit, their mean
    and min-max (a run has 2-5 repeats: too few for a bootstrap interval)."""
    rows = []
    for length, g in t.groupby("length"):
        full = g[g["path"] == "full"].set_index("repeat")["seconds"]
        for name, sel in (("transplant", (g["path"] == "transplant") & (g["seam"] == seam)),
                          ("limit", g["path"] == "limit")):
            other = g[sel].set_index("repeat")["seconds"]
            both = pd.concat([full, other], axis=1, join="inner").to_numpy(dtype=float)
            rows.append({"length": length, "path": name, **_band(both[:, 0] / both[:, 1])})
    return pd.DataFrame(rows)


def _band(x: np.ndarray) -> dict[str, float]:
    """kvnotes.measure.metrics.range_dict as a figure band: mean, lo = min, hi = max, n."""
    r = range_dict(x)
    return {"mean": r["mean"], "lo": r["min"], "hi": r["max"], "n": r["n"]}


def seconds_by_length(sel: pd.DataFrame) -> pd.DataFrame:
    """Per length: mean, min and max seconds over repeats (columns as analysis.aggregate.ci_table)."""
    rows = [{"length": length, **_band(g["seconds"].to_numpy(dtype=float))} for length, g in sel.groupby("length")]
    return pd.DataFrame(rows, columns=["length", "mean", "lo", "hi", "n"])


def timing(frame: pd.DataFrame) -> pd.DataFrame:
    """The timing rows, with one `limit` per run and length: the fastest of its timings."""
    t = frame[frame["job"] == "compose_scaling"] if "job" in frame else frame.iloc[:0]
    t = t[t["kind"] == "timing"] if len(t) and "kind" in t else t.iloc[:0]
    return fastest_limit(t)


LIMIT_PATHS = ("limit", "limit_engine", "limit_inplace")  # transformers; kvnotes: copy, in place


def fastest_limit(t: pd.DataFrame) -> pd.DataFrame:
    """Runs that time the question-only forward more than one way (`limit`: transformers alone;
    `limit_engine`: kvnotes' extend; `limit_inplace`: kvnotes over a cache held in place) keep
    the fastest by median as `limit` (kvnotes.engine.limit); a run that timed only `limit` keeps it."""
    if t.empty or not t["path"].isin(LIMIT_PATHS[1:]).any():
        return t
    lim = t[t["path"].isin(LIMIT_PATHS)]
    med = lim.groupby(["run_id", "length", "path"])["seconds"].median().unstack("path")
    fastest = med.idxmin(axis=1)  # per (run, length): the path to keep
    key = pd.MultiIndex.from_frame(t[["run_id", "length"]])
    keep = fastest.reindex(key).to_numpy()
    is_limit = t["path"].isin(LIMIT_PATHS).to_numpy()
    out = t[~is_limit | (t["path"].to_numpy() == keep)].copy()
    out.loc[out["path"].isin(LIMIT_PATHS), "path"] = "limit"
    return out


def headline_seam(frame: pd.DataFrame, run_id: str, t: pd.DataFrame) -> int:
    seam = job_params(frame, run_id).get("seam")
    if seam is None:  # no config: the largest transplant seam timed
        seam = int(t.loc[t["path"] == "transplant", "seam"].max())
    return int(seam)


def make(frame: pd.DataFrame, out: Path) -> list[Path]:
    t = timing(frame)
    if t.empty:
        raise Skip("no completed run of experiment compose_scaling")
    models = style.models_in(t)
    fig, axes = style.panels(2 * len(models), ncols=2, size=(5.0, 3.5))
    paper = {c["length"]: c["values"]["qwen3-8b"] for c in reference()["claims"].values() if "length" in c}
    # one tick set for every panel: our lengths, and the paper's only where none of ours is near
    ours = {float(x) for x in t["length"].unique()}
    ticks = ours | {float(n) for n in paper if all(abs(n - x) > 0.2 * n for x in ours)}
    for i, m in enumerate(models):
        d = t[t["model"] == m]
        seam = headline_seam(frame, str(d["run_id"].iloc[0]), d)
        ax, bx = axes[2 * i], axes[2 * i + 1]
        for path, col, lab in PATHS:
            sel = d[(d["path"] == path) & ((d["seam"] == seam) if path == "transplant" else True)]
            tt = seconds_by_length(sel)
            if len(tt):
                tt[["mean", "lo", "hi"]] *= 1000
                style.band(ax, tt, "length", f"{lab}{f' (seam {seam})' if path == 'transplant' else ''} ({style.n_range(tt)} repeats)", col)
        ax.set_xscale("log")
        ax.set_yscale("log")
        style.ticks_at(ax, ours)
        ax.set_xlabel("skill length (tokens, log)")
        ax.set_ylabel("time to first token (ms, log)")
        dev = d["device_record"].iloc[0] if "device_record" in d else d["device"].iloc[0]
        ax.set_title(f"{m} on {dev}")
        style.legend(ax, loc="upper left")
        sp = speedups(d, seam)
        for path, col, lab in PATHS[1:]:
            g = sp[sp["path"] == path]
            if len(g):
                style.band(bx, g, "length", f"full / {lab} ({style.n_range(g)} repeats)", col)
        bx.plot(list(paper), list(paper.values()), "x", color=style.PAPER, ms=7, ls=":", lw=0.8,
                label="paper: full / transplant (Qwen3-8B, GPU)")
        bx.axhline(1, color="k", lw=0.6)
        bx.set_xscale("log")
        bx.set_yscale("log")
        style.ticks_at(bx, ticks)
        bx.set_xlabel("skill length (tokens, log)")
        bx.set_ylabel("speedup (x, log)")
        bx.set_title(f"{m}: speedup over full prefill")
        style.legend(bx, loc="upper left")
    caption = ("TTFT = wall time from the request to the first token's logits, paths timed side by side in "
               "one process, order rotated every repeat. Left: mean over repeats; right: mean of the per-repeat "
               "ratios. n = repeats per length; shaded: min-max over the repeats (too few for a confidence "
               "interval). Grey: the paper's numbers, a different model on a GPU.")
    return style.finish(fig, TITLE, caption, out, NAME, t)
