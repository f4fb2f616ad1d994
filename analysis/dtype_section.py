"""The report's dtype section: what bfloat16 changes against float32 in the patching probe.

The claims read one run per (job, model, task, seed): the float32 one where both dtypes were run
(`analysis.load.latest`). A bf16 run of the same model and task is kept beside it in the reference
set to show what the dtype changes. This section reads both from their records.parquet: per run,
the usable items and the field-only, notes-only and full-downstream recoveries with 95 % bootstrap
CIs (analysis.aggregate, as every claim), and one bf16 score step (1/16 logit) in recovery units;
then, over the items usable in both runs (same seed and task: the same items), the paired
difference bf16 minus fp32 per condition.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis import load
from analysis.aggregate import ci_table, model_label, to_float
from analysis.claims import zero_eps
from analysis.sections import Inputs, section

CONDITIONS = ("field_only", "notes_only", "full_downstream")


def _cell(t: pd.DataFrame) -> str:
    if t.empty:
        return "-"
    r = t.iloc[0]
    return f"{r['mean']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"


def _paired(a: pd.DataFrame, b: pd.DataFrame, condition: str) -> tuple[str, int]:
    """bf16 minus fp32 recovery over items usable in both runs: (cell, n)."""
    x = a[a["condition"] == condition].groupby("item_id")["recovery"].mean()
    y = b[b["condition"] == condition].groupby("item_id")["recovery"].mean()
    both = x.index.intersection(y.index)
    if len(both) == 0:
        return "-", 0
    d = pd.DataFrame({"model": "m", "run_id": "paired", "item_id": both,
                      "diff": (to_float(x[both]) - to_float(y[both])).to_numpy()})
    return _cell(ci_table(d, "diff", ["model"], ("run_id", "item_id"))), len(both)


def dtype_section(results: str | Path) -> list[str]:
    """Lines of the section (empty when no model and task has patching runs in two dtypes)."""
    frame = load.load(results, jobs=["patching"], newest_only=False)
    if frame.empty or "dtype" not in frame:
        return []
    out: list[str] = []
    for (model, task), d in frame.groupby(["model", "task"], sort=True):
        runs = load.latest(d.drop_duplicates("run_id"), ("dtype",))
        if runs["dtype"].nunique() < 2 or not {"float32", "bfloat16"} <= set(runs["dtype"]):
            continue
        by = {str(r["dtype"]): d[d["run_id"] == r["run_id"]] for _, r in runs.iterrows()}
        out += [f"### {model_label(str(model))}, task {task}", "",
                "| dtype | run | usable items | " + " | ".join(f"{c} recovery" for c in CONDITIONS)
                + " | one bf16 step (recovery units) |", "|---" * (4 + len(CONDITIONS)) + "|"]
        for dtype in ("float32", "bfloat16"):
            r = by[dtype]
            n = r.loc[r["condition"] == "field_only", "item_id"].nunique()
            cells = [_cell(ci_table(r[r["condition"] == c], "recovery", ["model"])) for c in CONDITIONS]
            eps = zero_eps(r[r["condition"] == "field_only"].assign(dtype="bfloat16"))
            step = f"{float(eps.iloc[0]):.3f}" if len(eps) else "-"
            out.append(f"| {dtype} | `{r['run_id'].iloc[0]}` | {n} | " + " | ".join(cells) + f" | {step} |")
        paired = [_paired(by["bfloat16"], by["float32"], c) for c in CONDITIONS]
        n_both = max(n for _, n in paired)
        out += ["", f"bf16 minus fp32 over the {n_both} items usable in both runs: "
                + "; ".join(f"{c} {cell}" for c, (cell, _) in zip(CONDITIONS, paired)) + ".", ""]
    if not out:
        return []
    return ["## What the dtype changes", "", __doc__.split("\n\n")[1].replace("\n", " ").strip(), "", *out]


@section('bfloat16 beside float32', 100, jobs=('patching',), reads=('recovery',))
def _render(inputs: Inputs) -> list[str]:
    return dtype_section(inputs.results) if Path(inputs.results).is_dir() else []
