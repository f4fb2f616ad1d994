"""The report's distance section (beyond the paper): with the field after the rule and only filler
after it, field-only and notes-only recovery by field-to-decision distance, per model, read from each distance run's summary.json (`+experiment=distance`; the CIs
its job computed from records.parquet; analysis/figures/distance.py draws the same runs).

The reading rule was fixed before any distance run was read: at a distance d, the notes are ahead
when the paired difference notes-only minus field-only recovery over usable items has its 95 % CI
above 0, with at least MIN_USABLE usable items (fewer: undetermined, left out of the rule). The
takeover distance is the smallest d from which the notes are ahead at d and at every larger
determined distance.

The layout differs from `gated` in two things at once (the field follows the rule; only filler
follows the field), so the sweep says how recovery depends on distance in this layout, not where
notes take over in general: experiments/order.py crosses order, content and distance.
"""

from __future__ import annotations

import re
from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell
from analysis.load import newest_summaries
from analysis.sections import Inputs, section

TITLE = "Field after the rule, filler downstream: recovery by distance"
MIN_USABLE = 6  # half of the 12 items per distance of the reference runs


def size_of(label: str) -> float:
    """Parameters from a label such as 'llama (SmolLM2-135M-Instruct)' (inf when none is named)."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([mb])(?![a-z])", label.lower())
    return float(m.group(1)) * (1e6 if m.group(2) == "m" else 1e9) if m else float("inf")


def takeover(per: dict[str, Any]) -> tuple[int | None, list[int], list[int]]:
    """(takeover distance or None, determined distances, distances where the notes are ahead)."""
    rows = sorted(per.values(), key=lambda r: int(r["distance"]))
    det = [r for r in rows if int(r.get("n_usable") or 0) >= MIN_USABLE
           and isinstance(r.get("notes_minus_field"), dict) and r["notes_minus_field"].get("ci_lo") is not None]
    ahead = [int(r["distance"]) for r in det if r["notes_minus_field"]["ci_lo"] > 0]
    at = None
    for i, r in enumerate(det):
        if all(int(x["distance"]) in ahead for x in det[i:]):
            at = int(r["distance"])
            break
    return at, [int(r["distance"]) for r in det], ahead


def reading(label: str, per: dict[str, Any]) -> str:
    at, det, ahead = takeover(per)
    if not det:
        return f"{label}: undetermined (fewer than {MIN_USABLE} usable items at every distance)"
    if at is None:
        return f"{label}: the notes are not ahead of the field at any determined distance ({', '.join(map(str, det))})"
    if at == det[0]:
        return f"{label}: the notes are ahead at every determined distance, from {at} tokens"
    return f"{label}: the notes take over at {at} tokens (ahead at {', '.join(map(str, ahead))})"


def distance_section(frame: pd.DataFrame, figure: str | None = None) -> list[str]:
    """Markdown lines: per model, the sweep's table and its reading (`figure`: the distance figure's
    path relative to the report); [] when no distance run was read."""
    runs = newest_summaries(frame, "distance")
    if not runs:
        return []
    lines = [f"## {TITLE} (beyond the paper)", "",
             "Each item rendered with the field at several distances (tokens from the field's last token "
             "to the decision), same draws and total length (`+experiment=distance`). In this layout the "
             "field follows the rule, demonstrations and request, and only neutral filler follows the field; "
             "`gated` differs in both (field before the rule, task content after it), so the sweep varies "
             "distance within one layout and does not say which of order and content decides "
             "(`+experiment=order` crosses the three). Recoveries over usable "
             "items with 95 % bootstrap CIs; usable share with a Wilson CI; |delta| = |score_new - score_old| "
             "over all items. The rule, fixed before any distance run was read: the notes are *ahead* at a "
             "distance when notes-only minus field-only recovery has its CI above 0 with at least "
             f"{MIN_USABLE} usable items; they *take over* at the smallest distance from which they are "
             "ahead at every larger distance too.", ""]
    if figure:
        lines += [f"![distance]({figure})", ""]
    readings = []
    for model, run_id, s in sorted(runs, key=lambda r: size_of(model_label(r[0]))):
        label = model_label(model)
        per = s.get("per_distance") or {}
        lines += [f"### {label} ({s.get('n_items')} items per distance; margin {s.get('margin')}; run `{run_id}`)", "",
                  "| distance | n usable / n | usable share | mean abs delta | field-only | notes-only | notes - field |",
                  "|---|---|---|---|---|---|---|"]
        for d in sorted(per.values(), key=lambda r: int(r["distance"])):
            lines.append(f"| {d['distance']} | {d.get('n_usable')} / {d.get('n')} | {ci_cell(d.get('usable_share'), 2)} | "
                         f"{ci_cell(d.get('abs_delta'))} | {ci_cell(d.get('field_only'))} | "
                         f"{ci_cell(d.get('notes_only'))} | {ci_cell(d.get('notes_minus_field'))} |")
        readings.append(reading(label, per))
        lines += ["", readings[-1] + ".", ""]
    if len(readings) > 1:
        lines += ["By model size (smallest first): " + "; ".join(readings) + ". With a handful of models and "
                  "these intervals, this describes these models; it is not a test of a size trend.", ""]
    return lines


@section('Field-to-decision distance', 50, jobs=('distance',), reads=('per_distance',))
def _render(inputs: Inputs) -> list[str]:
    return distance_section(inputs.frame, inputs.figures.get("distance"))
