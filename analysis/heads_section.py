"""The report's read-head section: is the gap to the paper's top-12 recovery a ranking question?

Reads the newest cross-fitted `heads_heldout` run per model (its summary.json: the CIs its job
computed from records.parquet). On the same items, recovery from patching k heads at the decision token, with
heads ranked four ways: by attention to the notes (the paper's ranking), by their own effect on
the item (in sample: an upper bound), by their mean effect on the *other* items (held out: what a
ranking that never sees the item achieves), and at random. The paired differences at the paper's
k say whether the held-out ranking beats attention and how much of the in-sample curve survives.
Frozen-transfer runs (`experiment.frozen_from`: the heads chosen on one suite, tested unranked on
another) get their own table: the frozen heads beside each item's own attention ranking and
random heads, with the item and the domain-cluster interval.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell, cluster_pair
from analysis.load import summaries
from analysis.sections import Inputs, section

RANKINGS = (("attention", "attention to the notes"), ("effect_heldout", "effect on the other items (held out)"),
            ("effect", "effect on the item itself (in sample)"), ("random", "random"))


def _curve(s: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    curves = (s.get("heads") or {}).get("curves") or {}
    return {rk: {int(p["n_heads"]): p for p in pts} for rk, pts in curves.items()}


def heads_section(frame: pd.DataFrame) -> list[str]:
    """Markdown lines, one table per model with a heads_heldout run; [] when there is none."""
    # the newest cross-fitted run per model; a frozen-transfer run (experiment.frozen_from) has no
    # in-sample or held-out curve, and never stands in for one
    runs = list({m: (m, r, s) for m, r, s in summaries(frame, "heads_heldout") if "frozen" not in s}.values())
    if not runs:
        return []
    lines = ["## Read heads: ranking or protocol? (cross-fitted)", "",
             "Recovery when the outputs of k heads at the decision token are patched from the new run into the "
             "old (`+experiment=heads_heldout`), heads ranked four ways on the same items. The in-sample effect "
             "ranking sees the item it is scored on, so it is an upper bound; the held-out one ranks each item's "
             "heads by their mean effect on the other items. Means over items with 95 % bootstrap CIs (random: "
             "draws averaged per item first).", ""]
    for model, run_id, s in runs:
        curves = _curve(s)
        ks = sorted({k for c in curves.values() for k in c})
        present = [(rk, name) for rk, name in RANKINGS if rk in curves]
        lines += [f"### {model_label(model)} ({s.get('n_curve_items')} items; margin {s.get('margin')}; run `{run_id}`)", "",
                  "| k | " + " | ".join(name for _, name in present) + " |", "|---" * (1 + len(present)) + "|"]
        lines += [f"| {k} | " + " | ".join(ci_cell(curves[rk].get(k)) for rk, _ in present) + " |" for k in ks]
        diffs = [(key, v) for key, v in s.items() if key.startswith(("heldout_minus_attention_k", "effect_minus_heldout_k"))]
        if diffs:
            lines += ["", "Paired over items: " + "; ".join(
                f"{key.rsplit('_k', 1)[0].replace('_', ' ')} at k = {key.rsplit('_k', 1)[1]}: {ci_cell(v)}"
                for key, v in diffs) + "."]
            lines += ["", reading(s)]
        lines.append("")
    return lines + frozen_lines(frame)


FROZEN = (("frozen_effect", "frozen (effect on the source's items)"), ("frozen_attention", "frozen (attention)"),
          ("attention", "the item's own attention ranking"), ("random", "random"))


def frozen_lines(frame: pd.DataFrame) -> list[str]:
    """One row per frozen-transfer run: recovery of the top n_heads per ranking, item and domain-cluster
    intervals; [] when there is none."""
    runs = [(m, r, s) for m, r, s in summaries(frame, "heads_heldout") if "frozen" in s]
    if not runs:
        return []
    task = frame.drop_duplicates("run_id").set_index("run_id")["task"].to_dict() if "task" in frame else {}
    k_of = {r: int(s["frozen"].get("n_heads", 12)) for _, r, s in runs}
    present = [(rk, name) for rk, name in FROZEN if any(rk in (s.get(f"recovery_k{k_of[r]}") or {}) for _, r, s in runs)]
    lines = ["### Frozen read heads on other suites", "",
             "The heads ranked by their effect on the source run's items, frozen and patched without re-ranking "
             "on a suite they were not chosen on (`experiment.frozen_from`). Recovery of the top k, mean over "
             "items [95 % item bootstrap] (domain cluster bootstrap beside it).", "",
             "| model | suite | items | k | " + " | ".join(name for _, name in present) + " | source |",
             "|---" * (5 + len(present)) + "|"]
    for model, run_id, s in runs:
        k = k_of[run_id]
        cells = s.get(f"recovery_k{k}") or {}
        lines.append(f"| {model_label(model)} | {task.get(run_id, '?')} | {s.get('n_usable')} | {k} | "
                     + " | ".join(ci_cell(cells.get(rk), 2) + cluster_pair(cells.get(rk)) for rk, _ in present)
                     + f" | `{', '.join(s['frozen'].get('source_run') or [])}` |")
    return lines + [""]


def reading(s: dict[str, Any]) -> str:
    """One sentence from the paired differences' CIs: is the gap between the attention ranking and
    an effect ranking the ranking itself, and is the in-sample curve fit to its own item?"""
    key = next((k for k in s if k.startswith("heldout_minus_attention_k")), None)
    if key is None:
        return ""
    k = key.rsplit("_k", 1)[1]
    gap, fit = s.get(key) or {}, s.get(f"effect_minus_heldout_k{k}") or {}
    if not gap or not fit:
        return ""
    if gap["ci_lo"] > 0:
        out = (f"Reading: heads ranked on the other items recover more than heads ranked by attention at k = {k}: "
               "the shortfall of the attention ranking is the ranking, not the patching protocol, since heads "
               "found without seeing the item carry its decision")
    elif gap["ci_hi"] < 0:
        out = f"Reading: at k = {k} the attention ranking beats the held-out effect ranking"
    else:
        out = f"Reading: at k = {k} the held-out and attention rankings cannot be told apart"
    if fit["ci_lo"] > 0:
        out += "; the in-sample ranking recovers more still, so part of its curve is fit to the item it scores."
    else:
        out += "; the in-sample ranking adds nothing the held-out one does not find."
    over = [name for rk, name in RANKINGS if (p := _curve(s).get(rk, {}).get(int(k))) and p["ci_lo"] > 1]
    if over:
        out += (f" Above 1 at k = {k} ({', '.join(over)}): the patched heads push the decision past the new "
                "run's score, an overshoot, not a fuller recovery.")
    return out


@section('Read heads held out', 40, jobs=('heads_heldout',), reads=('curves', 'frozen'))
def _render(inputs: Inputs) -> list[str]:
    return heads_section(inputs.frame)
