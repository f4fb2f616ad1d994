"""What every cache probe shares: item usability by margin, record stamping, summaries with CIs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvnotes.metrics import bootstrap_ci
from kvnotes.patching import PatchPair, make_pair
from kvnotes.tasks.item import TaskItem


def item_fields(item: TaskItem) -> dict[str, Any]:
    return {
        "item_id": item.item_id,
        "suite": item.suite,
        "domain": item.domain,
        "template_id": item.template_id,
        "variant": item.variant,
        "n_tokens": item.n_tokens,
        "field_start": item.field_span[0],
        "field_end": item.field_span[1],
    }


def skip_reason(pair: PatchPair, margin: float) -> str | None:
    """Why an item cannot measure recovery: the model's decision barely depends on the field."""
    if not abs(pair.delta) >= margin:
        return f"|score_new - score_old| = {abs(pair.delta):.3g} < margin {margin:g}"
    return None


def run_pairs(
    model: Any,
    items: Iterable[TaskItem],
    margin: float | None,
    records_of: Callable[[PatchPair, float], list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """The loop every cache probe shares: stale/oracle pair per item, skip it below the margin
    (one `skipped` record saying why), else the probe's own records."""
    m = resolve_margin(model, margin)
    records: list[dict[str, Any]] = []
    for item in items:
        pair = make_pair(model, item)
        reason = skip_reason(pair, m)
        records += [skipped_record(pair, m, reason)] if reason else records_of(pair, m)
    return records


def skipped_record(pair: PatchPair, margin: float, reason: str) -> dict[str, Any]:
    return {
        **item_fields(pair.item),
        "condition": "skipped",
        "reason": reason,
        "margin": margin,
        "score_stale": pair.score_stale,
        "score_oracle": pair.score_oracle,
    }


def ci_dict(values: Iterable[float], n_boot: int = 1000) -> dict[str, float | int]:
    mean, lo, hi, n = bootstrap_ci(np.asarray(list(values), dtype=np.float64), n_boot=n_boot)
    return {"mean": mean, "ci_lo": lo, "ci_hi": hi, "n": n}


def resolve_margin(model: Any, margin: float | None) -> float:
    """The probe's margin, else the model registry's (the run config passes model.margin in)."""
    if margin is not None:
        return float(margin)
    spec = getattr(model, "spec", None)
    return float(spec.margin) if spec is not None else 1.0


def skip_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts of usable and skipped items, with the margin the records were judged by."""
    margins = sorted({float(r["margin"]) for r in records if "margin" in r})
    items = {r["item_id"] for r in records}
    skipped = [r for r in records if r.get("condition") == "skipped"]
    reasons: dict[str, int] = {}
    for r in skipped:
        key = str(r["reason"]).split(" = ")[0] + " < margin"
        reasons[key] = reasons.get(key, 0) + 1
    return {
        "margin": margins[0] if len(margins) == 1 else margins,
        "n_items": len(items),
        "n_usable": len(items) - len({r["item_id"] for r in skipped}),
        "n_skipped": len({r["item_id"] for r in skipped}),
        "skip_reasons": reasons,
    }


def by_condition(
    records: Sequence[Mapping[str, Any]], conditions: Sequence[str], key: str = "recovery"
) -> dict[str, Any]:
    return {c: ci_dict(r[key] for r in records if r.get("condition") == c) for c in conditions}


def curve(records: Sequence[Mapping[str, Any]], condition: str, x: str) -> list[dict[str, Any]]:
    """Mean recovery with CI at each value of `x` (e.g. layer, or k) for one condition."""
    rows = [r for r in records if r.get("condition") == condition]
    xs = sorted({r[x] for r in rows})
    return [{x: v, **ci_dict(r["recovery"] for r in rows if r[x] == v)} for v in xs]
