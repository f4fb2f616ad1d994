"""The report's order section (beyond the paper): field/rule order x what follows them x stretch,
per model, read from each order run's summary.json (`+experiment=order`; experiments/order.py
computed the CIs from records.parquet).

The hypothesis and the reading rule were written before any order run was read (docs/order.md):
a cell's carrier is `field` when notes-only minus field-only recovery has its interval below 0,
`notes` when above 0, `neither` when it spans 0 (the wider of the item bootstrap and the
domain-cluster one), `undetermined` with fewer usable items than the run's `min_usable`.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell
from analysis.distance_section import size_of
from analysis.load import newest_summaries
from analysis.sections import Inputs, section

TITLE = "Field/rule order x what follows them x stretch: which positions carry the decision"
HYPOTHESIS = (
    "Hypothesis H1, written before any order run was read: the conclusion is first written at the first "
    "positions that see both the field and the rule, and the decision reads its latest copy upstream of it; "
    "task content after both (demonstrations, request) restates it, neutral filler does not. Predicted "
    "carrier at every stretch: field before the rule, task content or filler after it: the notes; field "
    "after the rule with filler after it: the field; field after the rule with task content after it: the "
    "notes. Rivals: H2 (the decision reads the field unless task content follows both) predicts the field "
    "for field-before-rule/filler; H1' (first sight only, no restating) predicts the field for "
    "field-after-rule/task. A carrier that changes with the stretch refutes 'distance does not matter'.")


def cluster_cell(d: Any, digits: int = 3) -> str:
    """The domain-cluster interval of a summary entry (`ci_cluster`), or '-'."""
    c = d.get("ci_cluster") if isinstance(d, dict) else None
    if not isinstance(c, dict) or c.get("ci_lo") is None or c.get("ci_lo") != c.get("ci_lo"):
        return "-"
    return f"[{c['ci_lo']:.{digits}f}, {c['ci_hi']:.{digits}f}] ({c.get('n_clusters')} domains)"


def matches(pooled: dict[str, Any]) -> str:
    """Which of H1, H2, H1' the determined pattern over the four (order, content) pairs matches."""
    got = {oc: d.get("verdict") for oc, d in pooled.items()}
    carriers = {oc: d.get("carriers_by_stretch") or [] for oc, d in pooled.items()}

    def reads(oc: str, carrier: str) -> bool:
        c = carriers.get(oc, [])
        return bool(c) and sum(x == carrier for x in c) > len(c) / 2

    if any(v is None for v in got.values()) or len(got) < 4:
        return "not every (order, content) pair was run"
    if all(v == "as predicted" for v in got.values()):
        return "the pattern matches H1 at every (order, content)"
    out = []
    if reads("field_before_rule/filler", "field"):
        out.append("field-before-rule/filler reads the field, as the rival H2 predicts")
    if reads("field_after_rule/task", "field"):
        out.append("field-after-rule/task reads the field, as the rival H1' predicts")
    if reads("field_after_rule/filler", "notes"):
        out.append("field-after-rule/filler reads the notes, which refutes H1 and both rivals")
    changes = [oc for oc, d in pooled.items() if d.get("carrier_changes_with_stretch")]
    if changes:
        out.append("the carrier changes with the stretch in " + ", ".join(changes))
    open_ = [oc for oc, v in got.items() if v == "open"]
    if open_:
        out.append("open (no carrier at more than half the stretches) in " + ", ".join(open_))
    return "; ".join(out) if out else "H1 is not refuted, but not every pair reads as predicted"


def order_section(frame: pd.DataFrame) -> list[str]:
    """Markdown lines: per model, the 12 cells and the four pooled pairs; [] when no order run was read."""
    runs = newest_summaries(frame, "order")
    if not runs:
        return []
    lines = [f"## {TITLE} (beyond the paper)", "",
             "Each item of a gated field suite rendered in 2 x 2 x 3 cells, token-identical elsewhere "
             "(`+experiment=order`): the field line before or after the rule; between the later of the two and "
             "the task line, task content (demonstrations, request) or neutral filler; that stretch about 64, 256 "
             "or 1,024 tokens. Field-only and notes-only recovery over usable items (|delta| >= the margin) with "
             "95 % bootstrap CIs over items and, beside them, a cluster bootstrap over domains; usable share with "
             "a Wilson CI over all items. The carrier is read from the wider interval.", "", HYPOTHESIS, ""]
    for model, run_id, s in sorted(runs, key=lambda r: size_of(model_label(r[0]))):
        label = model_label(model)
        per, pooled = s.get("per_cell") or {}, s.get("per_order_content") or {}
        lines += [f"### {label} ({s.get('n_items')} items per cell; margin {s.get('margin')}; run `{run_id}`)", "",
                  "| field | after it | stretch (tokens) | n usable / n | usable share | mean abs delta | field-only "
                  "| notes-only | notes - field | notes - field, domain cluster | carrier | H1 predicts |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in per.values():
            tokens = (d.get("stretch_tokens") or {}).get("q50")
            lines.append(f"| {d['order'].replace('field_', '').replace('_', ' ')} | {d['content']} | {d['stretch']}"
                         f"{f' ({tokens:.0f})' if tokens is not None else ''} | {d.get('n_usable')} / {d.get('n')} | "
                         f"{ci_cell(d.get('usable_share'), 2)} | {ci_cell(d.get('abs_delta'))} | "
                         f"{ci_cell(d.get('field_only'))} | {ci_cell(d.get('notes_only'))} | "
                         f"{ci_cell(d.get('notes_minus_field'))} | {cluster_cell(d.get('notes_minus_field'))} | "
                         f"{d.get('carrier')} | {d.get('predicted')} |")
        lines += ["", "| field | after it | carriers by stretch | H1 predicts | verdict |", "|---|---|---|---|---|"]
        for oc, d in pooled.items():
            o, c = oc.split("/")
            lines.append(f"| {o.replace('field_', '').replace('_', ' ')} | {c} | "
                         f"{', '.join(d.get('carriers_by_stretch') or [])} | {d.get('predicted')} | {d.get('verdict')} |")
        lines += ["", f"{label}: {matches(pooled)}.", ""]
    return lines


@section('Order, content and distance', 60, jobs=('order',), reads=('cells', 'pooled'))
def _render(inputs: Inputs) -> list[str]:
    return order_section(inputs.frame)
