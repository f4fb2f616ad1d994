"""The report's knockout-as-decisions section: per knockout run and mask variant, the share of items
whose decision goes back to the old answer when the top 25 % most-attended keys are masked, raw
(pairwise argmax) and calibrated against the content-free prompt, each beside the same share under
count- and distance-matched random keys, with the share reaching reversion >= 0.5 and the share
moving away. Read from each run's summary.json (probes/knockout.py computed it from records).
A decision-variant rerun (`run_variant` "decisions", made for the content-free score) is listed
beside the full run, never in its place.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell, cluster_pair
from analysis.load import summaries
from analysis.sections import Inputs, section

VARIANTS = (("decision", "decision token only"), ("after_notes", "every later query"))


def share_cell(d: Any) -> str:
    """k/n mean [Wilson] (domain cluster lo, hi), or what is missing."""
    if not isinstance(d, dict) or not d.get("n"):
        return "- (not recorded)" if isinstance(d, dict) and d.get("why") else "-"
    return f"{d['k']}/{d['n']} {ci_cell(d, 2)}{cluster_pair(d)}"


def knockout_section(frame: pd.DataFrame) -> list[str]:
    """Markdown lines, one row per knockout run and variant that carries decision shares; [] if none."""
    rows = []
    for model, run_id, s in summaries(frame, "knockout"):
        for v, name in VARIANTS:
            d = s.get(v) or {}
            if "flip_share" not in d:
                continue
            top = (d.get("decisions") or {}).get("top") or {}
            rows.append(f"| {model_label(model)} | `{run_id}` | {name} | {share_cell(d['flip_share'])} | "
                        f"{share_cell(d.get('flip_share_random'))} | {share_cell(d.get('flip_share_calibrated'))} | "
                        f"{share_cell(d.get('flip_share_random_calibrated'))} | {share_cell(top.get('reached_half'))} | "
                        f"{share_cell(top.get('away'))} |")
    if not rows:
        return []
    return ["## Knockout read as decisions", "",
            "The top 25 % most-attended downstream keys masked (`+probe=knockout`): the share of items whose "
            "decision goes back to the old answer, over the items whose unmasked old and new prompts decide "
            "differently, raw (pairwise argmax) and calibrated (the content-free prompt's score subtracted first), "
            "each beside count- and distance-matched random keys; and over all usable items the share whose signed "
            "reversion reaches 0.5 (overshoot past 1.5 included) and the share moving away (reversion < 0). "
            "k/n, share [Wilson 95 %] (domain cluster bootstrap); \"not recorded\": the run predates the "
            "content-free score; the knockout claims read the full run's raw "
            "decisions, the wider of the two intervals.", "",
            "| model | run | mask | back (raw) | random (raw) | back (calibrated) | random (calibrated) "
            "| reversion >= 0.5 | moved away |", "|---" * 9 + "|", *rows, ""]


@section('Knockout as decisions', 30, jobs=('knockout',), reads=('decision', 'after_notes'))
def _render(inputs: Inputs) -> list[str]:
    return knockout_section(inputs.frame)
