"""The report's localization section (beyond the paper): where the notes are, ranked on held-out
items, per model, read from each localize run's summary.json (`+experiment=localize`;
experiments/shared/localize_summary.py computed it from records.parquet, and wrote the reading of
the hypothesis stated in experiments/localize.py before any run).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell, cluster_pair
from analysis.distance_section import size_of
from analysis.load import newest_summaries
from analysis.sections import Inputs, section

TITLE = "Where the notes are: positions ranked on held-out items"


def cluster_note(d: Any, digits: int = 2) -> str:
    """' (domain cluster [lo, hi])' of a summary cell that carries one, else ''."""
    pair = cluster_pair(d, digits)
    return f" (domain cluster [{pair[2:-1]}])" if pair else ""


def size_cell(d: Any) -> str:
    """The k80 size: median and quartiles first (sets beyond k_scan double, so a few large ones pull
    the mean up), then the mean with its CI."""
    q = d.get("quantiles") if isinstance(d, dict) else None
    if not isinstance(q, dict) or not q.get("n"):
        return ci_cell(d, 1)
    return (f"median {q['q50']:g} (quartiles {q['q25']:g}-{q['q75']:g}, 90th percentile {q['q90']:g}); "
            f"mean {ci_cell(d, 1)}")


def prop_cell(d: Any) -> str:
    """k/n with the Wilson interval of a prop_dict (and its domain-cluster interval), or '-'."""
    if not isinstance(d, dict) or not d.get("n"):
        return "-"
    return f"{d.get('k')}/{d['n']} {ci_cell(d, 2)}{cluster_note(d)}"


def localize_section(frame: pd.DataFrame, figure: str | None = None) -> list[str]:
    """Markdown lines per model: top-k recovery by ranking, the smallest set recovering the threshold,
    where it lies; [] when no localize run was read (`figure`: the localize figure's path)."""
    runs = newest_summaries(frame, "localize")
    if not runs:
        return []
    lines = [f"## {TITLE} (beyond the paper)", "",
             "Per usable item the exact single-position patching map (notes-only, one downstream position at a "
             "time); then on each item its positions ranked by the mean effect at the same place (segment and "
             "offset) on the *other* items of its group, never on its own map, and patched as nested top-k sets "
             "(`+experiment=localize`). In-sample (ranked on the item's own map) and random sets are shown "
             "beside; the paper's top-8 (0.74-0.79) was ranked in sample. Means over items with 95 % bootstrap "
             "CIs; shares of items with Wilson CIs; items of one domain share its words, so the headline "
             "numbers also give the domain cluster bootstrap (resampling whole domains), and a reading "
             "uses the wider of the two.", ""]
    if figure:
        lines += [f"![localize]({figure})", ""]
    for model, run_id, s in sorted(runs, key=lambda r: size_of(model_label(r[0]))):
        label = model_label(model)
        topk = s.get("topk") or {}
        ks = sorted({int(k) for r in topk.values() for k in r})
        lines += [f"### {label} ({s.get('n_ranked_items')} held-out items; run `{run_id}`)", "",
                  "| ranking | " + " | ".join(f"top-{k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
        for rk, by_k in topk.items():
            lines.append(f"| {rk} | " + " | ".join(ci_cell(by_k.get(k, by_k.get(str(k)))) for k in ks) + " |")
        k80 = s.get("k80") or {}
        seg = (s.get("k80_set") or {}).get("segments") or {}
        if k80:
            lines += ["", f"Smallest held-out set recovering {k80.get('threshold')}: reached on "
                      f"{prop_cell(k80.get('reached'))} items, with at most 16 positions on {prop_cell(k80.get('le_16'))}; "
                      f"its size over the items that reach it: {size_cell(k80.get('k'))}."]
        if seg:
            lines += ["", "| segment of the k80 set | share of its positions |", "|---|---|",
                      *[f"| {g} | {ci_cell(d, 2)} |" for g, d in seg.items()]]
        k80_set, top8 = s.get("k80_set") or {}, s.get("top8") or {}
        if k80_set.get("aggregator_share"):
            lines += ["", f"Of the k80 set's positions: aggregator tokens (newline, punctuation, section mark, special "
                      f"token) {ci_cell(k80_set['aggregator_share'], 2)}{cluster_note(k80_set['aggregator_share'])}; in the "
                      f"quarter of the downstream span the decision token attends to most "
                      f"{ci_cell(k80_set.get('attended_share'), 2)}{cluster_note(k80_set.get('attended_share'))}."]
        if top8.get("heldout"):
            paper = top8.get("paper") or []
            lines += ["", f"Top-8: held-out {ci_cell(top8['heldout'])}{cluster_note(top8['heldout'], 3)}, in sample "
                      f"{ci_cell(top8.get('in_sample'))}{cluster_note(top8.get('in_sample'), 3)}, in sample minus held-out "
                      f"{ci_cell(top8.get('in_sample_minus_heldout'))}{cluster_note(top8.get('in_sample_minus_heldout'), 3)}"
                      + (f"; the paper, in sample, {paper[0]:.2f}-{paper[1]:.2f}" if len(paper) == 2 else "") + "."]
        if s.get("reading"):
            lines += ["", f"{label}: {s['reading']}"]
        lines += [""]
    return lines


@section('Localization on held-out items', 70, jobs=('localize',), reads=('k_threshold', 'sets'))
def _render(inputs: Inputs) -> list[str]:
    return localize_section(inputs.frame, inputs.figures.get("localize_notes"))
