"""The report's section on a user's own prompts: the probes run on a prompts file (`task=pairs`).

Per model, from each run's summary.json (the intervals its probe computed) and its records: the
patching probe's usable pairs (Wilson), field-only / notes-only / full-downstream recovery with the
item bootstrap and the cluster bootstrap over the file's `cluster`s, and beside each mean what it
hides: the median, the quartiles, the share of pairs below 0 (moved the wrong way) and above 1.5
(overshoot); the knockout probe's decisions sent back to the corrupt answer by the most-attended
quarter of the notes against matched random keys; attribution's agreement with exact patching.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell, cluster_pair
from analysis.knockout_section import share_cell
from analysis.load import USER_TASKS, newest_summaries
from analysis.sections import Inputs, section
from kvnotes.measure.metrics import wilson_ci

CONDITIONS = ("field_only", "notes_only", "full_downstream")


def _usable(s: dict[str, Any]) -> str:
    n, k = int(s.get("n_items") or 0), int(s.get("n_usable") or 0)
    if not n:
        return "-"
    _, lo, hi = wilson_ci(k, n)
    return f"{k}/{n} [{lo:.2f}, {hi:.2f}]"


def spread(values: np.ndarray) -> str:
    """median [quartiles]; share < 0 and > 1.5 of per-pair recoveries."""
    v = values[np.isfinite(values)]
    if not v.size:
        return "-"
    q1, med, q3 = np.quantile(v, [0.25, 0.5, 0.75])
    return (f"{med:.2f} [{q1:.2f}, {q3:.2f}]; < 0: {int((v < 0).sum())}/{v.size}, "
            f"> 1.5: {int((v > 1.5).sum())}/{v.size}")


def _per_pair(frame: pd.DataFrame, run_id: str, condition: str) -> np.ndarray:
    d = frame[(frame["run_id"] == run_id) & (frame["condition"] == condition)] if "run_id" in frame else frame.iloc[:0]
    if d.empty or "recovery" not in d:
        return np.zeros(0)
    return pd.to_numeric(d["recovery"], errors="coerce").to_numpy(dtype=float)


def _stat(stats: dict[str, Any], clustered: dict[str, Any], key: str) -> str:
    """mean [item interval] (cluster interval) of one attribution statistic."""
    c = clustered.get(key)
    lo = c.get("ci_lo") if isinstance(c, dict) else None
    return ci_cell(stats.get(key), 3) + (f" ({lo:.3f}, {c['ci_hi']:.3f})" if lo is not None and lo == lo else "")


def pairs_section(frame: pd.DataFrame) -> list[str]:
    """Markdown lines for the runs on a prompts file; [] when there are none."""
    patch = newest_summaries(frame, "patching", user=True)
    if not patch:
        return []
    tasks = ", ".join(sorted(USER_TASKS))
    lines = ["### Your own prompts: the probes on a prompts file", "",
             f"Runs with `task={tasks}` (`examples/pairs/own_pairs.jsonl`: pairs written for the toolkit, not rendered "
             "from its templates, in clusters of one scenario each). Recovery: mean [item bootstrap 95 %] "
             "(cluster bootstrap over the file's clusters); beside it the per-pair median [quartiles] and the "
             "pairs that moved the wrong way (< 0) or overshot (> 1.5).", "",
             "| model | run | usable pairs (Wilson) | condition | recovery | median [IQR]; wrong way; overshoot |",
             "|---|---|---|---|---|---|"]
    for model, run_id, s in patch:
        rec = s.get("recovery") or {}
        for c in CONDITIONS:
            lines.append(f"| {model_label(model)} | `{run_id}` | {_usable(s)} | {c} | {ci_cell(rec.get(c), 2)}"
                         f"{cluster_pair(rec.get(c))} | {spread(_per_pair(frame, run_id, c))} |")
    knock = newest_summaries(frame, "knockout", user=True)
    if knock:
        lines += ["", "Knockout on the clean cache, decision token only: pairs whose decision goes back to the "
                  "corrupt answer, k/n mean [Wilson] (cluster), the most-attended quarter of the notes against "
                  "matched random keys; median signed reversion of each.", "",
                  "| model | run | flip share, top keys | flip share, matched random | median reversion top / random |",
                  "|---|---|---|---|---|"]
        for model, run_id, s in knock:
            d = s.get("decision") or {}
            top, rnd = (d.get(k) or {} for k in ("top", "random_matched"))
            lines.append(f"| {model_label(model)} | `{run_id}` | {share_cell(d.get('flip_share'))} | "
                         f"{share_cell(d.get('flip_share_random'))} | {top.get('median', float('nan')):.2f} / "
                         f"{rnd.get('median', float('nan')):.2f} |")
    attr = newest_summaries(frame, "attribution", user=True)
    if attr:
        lines += ["", "Attribution over the cache against exact patching: Spearman over positions and over "
                  "position x layer cells, mean [item bootstrap] (cluster).", "",
                  "| model | run | pairs | Spearman, positions | Spearman, position x layer | top-8 overlap |",
                  "|---|---|---|---|---|---|"]
        for model, run_id, s in attr:
            st, cl = s.get("stats") or {}, s.get("stats_cluster") or {}
            lines.append(f"| {model_label(model)} | `{run_id}` | {s.get('n_usable', '-')} | "
                         + " | ".join(_stat(st, cl, k) for k in ("spearman_position", "spearman_position_layer",
                                                                "overlap_8")) + " |")
    return [*lines, ""]


@section('Your own prompts', 90, jobs=('patching', 'knockout', 'attribution'), reads=('recovery', 'decision', 'stats'))
def _render(inputs: Inputs) -> list[str]:
    return pairs_section(inputs.frame)
