"""The report's head-to-head section: cache reuse methods per budget, read from each blend run's
summary.json (the CIs its job computed from records.parquet; analysis/figures/blend.py draws the
same runs). Beyond the paper: no band, no verdict; the frontier per budget and the target stated
in the issue (within 1 % of full-prefill task score at <= 15 % recompute)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from analysis.aggregate import model_label
from analysis.load import summaries
from analysis.sections import Inputs, section

SEAMS_SHOWN = (2, 8, 32)  # seam repair K read out beside the budgets below
BUDGETS_SHOWN = ("@15%", "@20%")  # budgeted methods shown in the table (every budget is in the frontier line)


def ci_cell(v: Any, digits: int = 3) -> str:
    if isinstance(v, dict) and v.get("mean") is not None:
        return f"{v['mean']:.{digits}f} [{v['ci_lo']:.{digits}f}, {v['ci_hi']:.{digits}f}]"
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else "-"


def cluster_pair(d: Any, digits: int = 2) -> str:
    """' (lo, hi)' of a summary cell's cluster interval (domain, or a LoCoMo item's conversation) (`ci_cluster`), '' when it has none
    or it is NaN (one cluster)."""
    c = d.get("ci_cluster") if isinstance(d, dict) else None
    lo = c.get("ci_lo") if isinstance(c, dict) else None
    if lo is None or lo != lo:
        return ""
    return f" ({lo:.{digits}f}, {c['ci_hi']:.{digits}f})"


def _mean(v: Any) -> float | None:
    return v.get("mean") if isinstance(v, dict) else v if isinstance(v, (int, float)) else None


def kvboost_label(name: str, m: dict[str, Any]) -> str:
    """A kvboost row's name with what ran: its configured label says the setting asked for, and
    kvboost's cacheblend re-prefills every cached token (its step 1), whatever its ratio."""
    frac = _mean(m.get("recompute_fraction"))
    if not name.startswith("kvboost") or frac is None:
        return name
    ran = "every block token re-prefilled" if frac >= 0.99 else f"{frac:.0%} of block tokens recomputed"
    return f"{name} (ran: {ran})"


def kvboost_notes(methods: dict[str, dict[str, Any]]) -> list[str]:
    """A line for each pair of kvboost rows that are the same run in effect (equal recompute,
    cosine and task score), e.g. a cacheblend setting forced to a full re-prefill beside selective."""
    kv = {n: m for n, m in methods.items() if n.startswith("kvboost")}
    keys = ("recompute_fraction", "cosine", "task_score")
    same = [(a, b) for i, a in enumerate(kv) for b in list(kv)[i + 1:]
            if all(_mean(kv[a].get(k)) is not None and _mean(kv[a].get(k)) == _mean(kv[b].get(k)) for k in keys)]
    return ["", *(f"`{a}` and `{b}` gave the same mean recompute fraction, logit cosine and task score: "
                  "in effect the same computation, whatever their labels say." for a, b in same)] if same else []


def blend_section(frame: pd.DataFrame) -> list[str]:
    """Markdown lines: per model and workload, the methods at the 15 % and 20 % budgets (the issue's
    target and the budget ProphetKV reports at) and seam K = 2, 8, 32, and the frontier per budget;
    [] when no blend run was read."""
    newest: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}  # (model, workload) -> newest run
    for model, run_id, s in summaries(frame, "blend"):
        for wl, w in (s.get("workloads") or {}).items():
            newest[(model, wl)] = (run_id, w)
    if not newest:
        return []
    lines = ["## Cache reuse head to head (beyond the paper)", "",
             "Every method on the same items and blocks (`+experiment=blend`): each block prefilled alone "
             "and RoPE-moved to where it lands. Means with 95 % CIs over items (Wilson for agreement "
             "shares); task scores also give, in parentheses, the cluster bootstrap that resamples whole "
             "LoCoMo conversations or whole domains (items of one share a speaker pair or a template); recompute fraction = recomputed block tokens / block tokens; TTFT ratio = the "
             "method's wall time to the first token / full prefill's (lower is faster). kvboost runs as it "
             "ships, in its own venv; its fraction counts every token its engine ran. No method here "
             "needs the oracle. The target from the issue, fixed before these runs: within 1 % of "
             "full-prefill task score at <= 15 % recompute.", ""]
    for (model, wl), (run_id, w) in newest.items():
        methods = w.get("methods") or {}
        lines += [f"### {model_label(model)}, {wl} ({w.get('n_items')} items; run `{run_id}`)", "",
                  "| method | recompute | logit cosine | top-1 agree | decision agree | task score | task score - full "
                  "| TTFT ratio |", "|---" * 8 + "|"]
        shown = [n for n in methods if n in ("full", "naive") or n.endswith(BUDGETS_SHOWN) or n.startswith("kvboost")
                 or n in {f"seam@{k}" for k in SEAMS_SHOWN}]
        for name in shown:
            m = methods[name]
            lines.append(f"| {kvboost_label(name, m)} | {ci_cell(m.get('recompute_fraction'))} | {ci_cell(m.get('cosine'))} | "
                         f"{ci_cell(m.get('top1_agree'), 2)} | {ci_cell(m.get('decision_agree'), 2)} | "
                         f"{ci_cell(m.get('task_score'))}{cluster_pair(m.get('task_score'), 3)} | "
                         f"{ci_cell(m.get('task_delta'))}{cluster_pair(m.get('task_delta'), 3)} | {ci_cell(m.get('ttft_ratio'), 2)} |")
        lines += kvboost_notes(methods)
        front = w.get("frontier") or {}
        cells = []
        for budget, best in front.items():
            parts = [f"{metric} {b['name']} ({b['value']:.3f})" for metric, b in best.items() if b]
            cells.append(f"<= {float(budget):.0%}: " + ", ".join(parts))
        lines += ["", "Frontier (best mean within each budget): " + "; ".join(cells) + "."]
        ok = w.get("within_1pct_at_15pct")
        if ok is not None:
            full = _mean((methods.get("full") or {}).get("task_score"))
            lines += [f"Not more than 1 % below full prefill's task score ({full:.3f}) at <= 15 %: "
                      + (", ".join(ok) if ok else "none") + " (means; read with the CIs above).", ""]
        lines += versus_lines(w.get("versus_cacheblend") or {}, wl)
    return lines


def versus_lines(vs: dict[str, Any], workload: str) -> list[str]:
    """The paired comparison with CacheBlend at each budget (experiments.blend.versus_cacheblend)."""
    if not vs:
        return []
    unit = "conversation" if workload == "locomo" else "domain"
    lines = [f"Against CacheBlend at the same recompute budget, paired on items: method - CacheBlend, mean "
             f"[item bootstrap] ({unit} cluster bootstrap). Beats: the wider of the two intervals of the task-score "
             "difference lies above 0; disjoint: the method's own task-score interval lies above CacheBlend's.", "",
             "| budget | method | items | task score difference | logit cosine difference | beats | disjoint |",
             "|---" * 7 + "|"]
    for budget, v in vs.items():
        for name, r in (v.get("methods") or {}).items():
            lines.append(f"| {budget} | {name} | {r.get('n')} | {ci_cell(r.get('task_score'))}"
                         f"{cluster_pair(r.get('task_score'), 3)} | {ci_cell(r.get('cosine'), 4)}"
                         f"{cluster_pair(r.get('cosine'), 4)} | {'yes' if name in v.get('beats', []) else 'no'} | "
                         f"{'yes' if r.get('disjoint') else 'no'} |")
    return [*lines, ""]


@section('Composition head to head (blend)', 10, jobs=('blend',), reads=('workloads', 'methods', 'versus'))
def _render(inputs: Inputs) -> list[str]:
    return blend_section(inputs.frame)
