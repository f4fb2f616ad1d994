"""The plain-text table a finished run prints: counts, then every mean with its CI and n."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

HEADLINE = ("n_items", "n_usable", "n_skipped", "n_usable_recovery", "n_usable_p_correct", "n_usable_p_correct_raw",
            "margin")


def _ci_rows(node: Any, path: str) -> Iterable[tuple[str, Mapping[str, Any]]]:
    if isinstance(node, Mapping):
        if "mean" in node and "n" in node:
            yield path, node
            return
        for key, sub in node.items():
            yield from _ci_rows(sub, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list) and node and all(isinstance(x, Mapping) and "mean" in x for x in node):
        for x in node:  # a curve: label each point by its first non-statistic key (k, layer, band)
            label = next((f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in x.items() if k not in ("mean", "ci_lo", "ci_hi", "n")), "")
            yield f"{path}[{label}]", x


def _cell(r: Mapping[str, Any]) -> str:
    def num(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, int | float) and x == x else "nan"

    return f"{num(r['mean'])} [{num(r.get('ci_lo'))}, {num(r.get('ci_hi'))}] n={r['n']}"


def summary_table(summary: Mapping[str, Any], max_rows: int = 60) -> str:
    """A short plain-text table of a summary: the item counts, then every mean with its CI and n,
    then the summary's one-line `reading` and its `margin_rule`.

    Metrics that repeat under several groups (p_correct, recovery, ... per strategy) become one
    row per group with a column per metric; a curve (a list of points) gives a row per point.
    A run with no usable item prints one line saying so and what to try, never a table of NaN.
    """
    title = " ".join(str(summary[k]) for k in ("kind", "name", "model") if k in summary)
    counts = "  ".join(f"{k}={summary[k]}" for k in HEADLINE if k in summary)
    rows = list(_ci_rows({k: v for k, v in summary.items() if k not in HEADLINE}, ""))
    lines = [title, counts] if counts else [title]
    if summary.get("no_usable") or (rows and summary.get("n_items") and all(not r.get("n") for _, r in rows)):
        return "\n".join([*lines, str(summary.get("no_usable") or (
            f"no usable item: every mean is over 0 of {summary['n_items']} items at margin "
            f"{summary.get('margin')}. Try a model that conditions on the field (qwen-1.5b) or a margin "
            "derived by the rule of kvnotes.measure.margins (python -m analysis.margin <gated-control run>)."))])
    notes = [f"{k.replace('_', ' ')}: {summary[k]}" for k in ("reading", "margin_rule")
             if isinstance(summary.get(k), str)]

    def cell(r: Mapping[str, Any]) -> str:  # timings carry a min-max range, never called a CI
        if r.get("interval") == "min-max":
            return f"{r['mean']:.3f} (min-max {r['min']:.3f}-{r['max']:.3f}) n={r['n']}"
        return _cell(r)
    groups: dict[str, dict[str, Mapping[str, Any]]] = {}
    for path, r in rows:
        head, _, leaf = path.rpartition(".")
        groups.setdefault(head, {})[leaf] = r
    leaves = [tuple(g) for g in groups.values()]
    wide = len(groups) > 1 and all(len(g) > 1 for g in leaves) and len(set(leaves)) == 1
    if not rows:
        scalars = [f"{k}: {v}" for k, v in summary.items()
                   if isinstance(v, int | float | str | bool) and k not in ("kind", "name", "model", "finished")
                   and k not in ("reading", "margin_rule")]
        return "\n".join(lines + scalars + notes)
    if wide:
        cols = list(leaves[0])
        table = [["", *cols]] + [[head, *(cell(g[c]) for c in cols)] for head, g in groups.items()]
    else:
        table = [["metric", "mean [95% CI] n"]] + [[p, cell(r)] for p, r in rows]
    shown = table[: max_rows + 1]
    widths = [max(len(row[i]) for row in shown) for i in range(len(shown[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in shown]
    if len(table) > len(shown):
        lines.append(f"... {len(table) - len(shown)} more rows in summary.json")
    return "\n".join(lines + notes)
