"""The report's unseen-domain section: the 12 tuned gated domains beside six written afterwards.

`gated-fresh` holds six domains whose fields, values, outcome words and requests appear in none of
the 12 `gated` ones, and which no prompt, margin or threshold was tuned on. Per model that has
runs of both suites, this section reads each run's summary.json (the CIs its job computed from
records.parquet, as every claim) and puts the two suites side by side: the patching probe's
usable items (Wilson CI) and field-only, notes-only and full-downstream recoveries, and the edit
experiment's P(correct) and recovery per strategy. The suites hold different items, so the two
columns are compared, not paired.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.blend_section import ci_cell
from analysis.sections import Inputs, section
from kvnotes.edit import registry
from kvnotes.measure import runfiles
from kvnotes.measure.metrics import wilson_ci

SUITES = ("gated", "gated-fresh")
CONDITIONS = ("field_only", "notes_only", "full_downstream")


def _summaries(frame: pd.DataFrame, job: str) -> dict[str, dict[str, tuple[str, dict[str, Any]]]]:
    """model -> suite -> (run_id, summary.json) of the newest plain (not CoT-only) run."""
    if frame.empty or "job" not in frame:
        return {}
    runs = frame[(frame["job"] == job) & frame["task"].isin(SUITES)]
    if "run_variant" in runs:
        runs = runs[runs["run_variant"].fillna("") == ""]
    out: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {}
    for r in runs.drop_duplicates("run_id").sort_values("run_id").itertuples():
        try:
            summary = json.loads((Path(str(r.run_path)) / runfiles.SUMMARY).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out.setdefault(str(r.model), {})[str(r.task)] = (str(r.run_id), summary)  # newest wins
    return {m: by for m, by in out.items() if set(SUITES) <= set(by)}


def _usable(s: dict[str, Any], key: str = "n_usable") -> str:
    n, k = int(s.get("n_items") or 0), s.get(key)
    if not n or k is None:
        return "-"
    _, lo, hi = wilson_ci(int(k), n)
    return f"{int(k)}/{n} [{lo:.2f}, {hi:.2f}]"


def _patching(by: dict[str, tuple[str, dict[str, Any]]]) -> list[str]:
    lines = ["| suite | run | usable (Wilson 95 % CI) | " + " | ".join(f"{c} recovery" for c in CONDITIONS) + " |",
             "|---" * (3 + len(CONDITIONS)) + "|"]
    for suite in SUITES:
        run_id, s = by[suite]
        rec = s.get("recovery") or {}
        lines.append(f"| {suite} | `{run_id}` | {_usable(s)} | " + " | ".join(ci_cell(rec.get(c)) for c in CONDITIONS) + " |")
    return lines


def edit_rows(by: dict[str, tuple[str, dict[str, Any]]]) -> list[str]:
    """The strategies of the runs that a system can run (kvnotes.edit.registry: no oracle needed,
    the oracle itself left out: it is the reference), in the registry's order."""
    labels = {k for _, summary in by.values() for k in (summary.get("strategies") or {})}
    order = {n: i for i, n in enumerate(registry.names())}
    keep = [lab for lab in labels if (s := registry.base_of(lab)) is not None
            and not s.needs_oracle and s.name != "oracle"]
    return sorted(keep, key=lambda lab: (order[registry.base_of(lab).name], lab))  # type: ignore[union-attr]


def _edit(by: dict[str, tuple[str, dict[str, Any]]]) -> list[str]:
    lines = ["| strategy | " + " | ".join(f"{s} P(correct) | {s} recovery" for s in SUITES)
             + " | recomputed share of the prompt (" + " / ".join(SUITES) + ") |",
             "|---" * (2 + 2 * len(SUITES)) + "|"]
    for name in edit_rows(by):
        cells, cost = [], []
        for suite in SUITES:
            st = (by[suite][1].get("strategies") or {}).get(name) or {}
            pc = st.get("p_correct")
            pc_cell = (f"{pc['k']}/{pc['n']} {ci_cell(pc, 2)}" if isinstance(pc, dict) and pc.get("n") else "-")
            cells += [pc_cell, ci_cell(st.get("recovery"))]
            frac = st.get("recompute_fraction")
            cost.append(f"{frac['mean']:.3f}" if isinstance(frac, dict) and frac.get("mean") is not None else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {' / '.join(cost)} |")
    runs = ", ".join(f"{s} `{by[s][0]}` ({by[s][1].get('n_usable_p_correct')} usable for P(correct), "
                     f"{by[s][1].get('n_usable_recovery')} for recovery, of {by[s][1].get('n_items')})" for s in SUITES)
    return [*lines, "", f"Runs: {runs}."]


def fresh_section(frame: pd.DataFrame) -> list[str]:
    """Markdown lines; [] when no model has patching or edit runs on both suites."""
    patching, edit = _summaries(frame, "patching"), _summaries(frame, "edit")
    models = sorted(set(patching) | set(edit))
    if not models:
        return []
    out = ["## Unseen domains: the tuned suite beside six fresh domains", "",
           __doc__.split("\n\n")[1].replace("\n", " ").strip(), ""]
    for model in models:
        out += [f"### {model_label(model)}", ""]
        if model in patching:
            out += ["Patching (recovery over usable items, 95 % bootstrap CI):", "", *_patching(patching[model]), ""]
            reading = patching[model]["gated-fresh"][1].get("reading")
            if reading:
                out += [f"Fresh suite, the probe's own reading: {reading}", ""]
        if model in edit:
            out += ["Edit (P(correct) with Wilson CI over items usable for it; recovery with 95 % bootstrap CI; a "
                    "recovery above 1 moves the decision past where the oracle prefill puts it, an overshoot, so "
                    "P(correct) is the reading for the erratum strategies):", "",
                    *_edit(edit[model]), ""]
        else:
            out += ["Edit: no run on both suites yet.", ""]
    return out


@section('Unseen domains (gated-fresh)', 20, jobs=('patching', 'edit'), reads=('n_usable', 'recovery', 'strategies'))
def _render(inputs: Inputs) -> list[str]:
    return fresh_section(inputs.frame)
