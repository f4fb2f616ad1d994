"""Which items a model actually conditions on: the gate every probe applies before measuring.

An item is *usable for recovery* when |score_new - score_old| >= margin: recovery divides by
that difference, and the paper's 1e-4 floor lets noise on small models blow recoveries up, so
the margin (default 1.0 logit, a model config may set its own) is reported with every count.
It is *usable for P(correct)* when, in addition, the decision (argmax among outcomes, by default
calibrated against the content-free prompt) is correct under both values. Skipped items are
counted by reason, never dropped silently.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvnotes.measure import margins
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.scoring import ItemScore, score_items

Criterion = Literal["recovery", "correct"]
DEFAULT_MARGIN = 1.0


def skip_reason(
    s: ItemScore, item: TaskItem, margin: float, criterion: Criterion, calibrated: bool = True
) -> str | None:
    """None when usable; else small_delta, wrong_old, wrong_new or wrong_both."""
    if margins.unusable(s.delta, margin):  # NaN is not usable
        return "small_delta"
    if criterion == "recovery":
        return None
    ok_old = s.decision("old", calibrated) == item.correct_old
    ok_new = s.decision("new", calibrated) == item.correct_new
    if ok_old and ok_new:
        return None
    return "wrong_both" if not (ok_old or ok_new) else ("wrong_new" if ok_old else "wrong_old")


def record(item: TaskItem, s: ItemScore, margin: float, calibrated: bool = True) -> dict[str, Any]:
    """One flat row per item: scores, decisions (raw and calibrated), usability and why not."""
    cal = calibrated and s.logits_cf is not None
    dec_old, dec_new = s.decision("old", cal), s.decision("new", cal)
    reason_rec = skip_reason(s, item, margin, "recovery", cal)
    reason_cor = skip_reason(s, item, margin, "correct", cal)
    return {
        "item_id": item.item_id,
        "suite": item.suite,
        "domain": item.domain,
        "variant": item.variant,
        "template_id": item.template_id,
        "field": item.field_name,
        "old_value": item.old_value,
        "new_value": item.new_value,
        "n_tokens": item.n_tokens,
        "correct_old": item.correct_old,
        "correct_new": item.correct_new,
        "readout": "calibrated" if cal else "raw",
        "decision_old": dec_old,
        "decision_new": dec_new,
        "argmax_old": s.argmax_old,
        "argmax_new": s.argmax_new,
        "logits_old": list(s.logits_old),
        "logits_new": list(s.logits_new),
        "logits_cf": list(s.logits_cf) if s.logits_cf is not None else None,
        "score_old": s.score_old,
        "score_new": s.score_new,
        "delta": s.delta,
        "abs_delta": abs(s.delta),
        "acc_old": dec_old == item.correct_old,
        "acc_new": dec_new == item.correct_new,
        "flipped": dec_old != dec_new,
        "raw_acc_old": s.argmax_old == item.correct_old,
        "raw_acc_new": s.argmax_new == item.correct_new,
        "raw_flipped": s.argmax_old != s.argmax_new,
        "margin": margin,
        "usable_recovery": reason_rec is None,
        "usable_correct": reason_cor is None,
        "skip_recovery": reason_rec,
        "skip_correct": reason_cor,
    }


def validate(
    model: LoadedModel,
    items: Sequence[TaskItem],
    margin: float = DEFAULT_MARGIN,
    calibrate: bool = True,
) -> list[dict[str, Any]]:
    """Score every item and mark it usable or skipped (with the reason) at `margin`.

    `calibrate` reads decisions against the content-free prompt (items that have one).
    """
    scores = score_items(model, items, calibrate)
    return [record(it, s, margin, calibrate) for it, s in zip(items, scores, strict=True)]


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def _group(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "n": len(rows),
        "accuracy_old": _mean(float(r["acc_old"]) for r in rows),
        "accuracy_new": _mean(float(r["acc_new"]) for r in rows),
        "flip_rate": _mean(float(r["flipped"]) for r in rows),
        "mean_abs_delta": _mean(r["abs_delta"] for r in rows),
        "mean_delta": _mean(r["delta"] for r in rows),
        "raw_accuracy_old": _mean(float(r["raw_acc_old"]) for r in rows),
        "raw_accuracy_new": _mean(float(r["raw_acc_new"]) for r in rows),
        "raw_flip_rate": _mean(float(r["raw_flipped"]) for r in rows),
        "n_usable": sum(bool(r["usable_recovery"]) for r in rows),
        "n_usable_correct": sum(bool(r["usable_correct"]) for r in rows),
    }


def summarize(records: Sequence[Mapping[str, Any]], margin: float | None = None) -> dict[str, Any]:
    """Totals and per-domain figures; the margin used and the skips by reason are always in."""
    if margin is None:
        margins = {r["margin"] for r in records}
        margin = margins.pop() if len(margins) == 1 else math.nan
    by_domain: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in records:
        by_domain[r["domain"]].append(r)
    overall = _group(records)
    return {
        "n_items": len(records),
        "n_usable": overall["n_usable"],
        "n_usable_correct": overall["n_usable_correct"],
        "margin": margin,
        "readout": sorted({str(r["readout"]) for r in records}),
        "skipped_recovery": dict(Counter(r["skip_recovery"] for r in records if r["skip_recovery"])),
        "skipped_correct": dict(Counter(r["skip_correct"] for r in records if r["skip_correct"])),
        "overall": overall,
        "per_domain": {d: _group(rows) for d, rows in sorted(by_domain.items())},
    }


def usable_ids(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The content of usable_ids.json: ids per criterion, the margin and the skip counts."""
    s = summarize(records)
    return {
        "margin": s["margin"],
        "n_items": s["n_items"],
        "readout": s["readout"],
        "recovery": [r["item_id"] for r in records if r["usable_recovery"]],
        "correct": [r["item_id"] for r in records if r["usable_correct"]],
        "calibration": {r["item_id"]: r["logits_cf"] for r in records
                        if r.get("logits_cf") is not None},
        "skipped_recovery": s["skipped_recovery"],
        "skipped_correct": s["skipped_correct"],
    }


@dataclass(frozen=True)
class Selection:
    """The items a probe may use, and how many were skipped and why."""

    items: list[TaskItem]
    criterion: str
    margin: float
    n_total: int
    skipped: dict[str, int] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        return {"criterion": self.criterion, "margin": self.margin, "n_total": self.n_total,
                "n_used": len(self.items), "skipped": dict(self.skipped)}


def select_usable(
    items: Sequence[TaskItem],
    validation: Sequence[Mapping[str, Any]] | Mapping[str, Any] | str | Path,
    criterion: Criterion = "recovery",
) -> Selection:
    """Keep the usable items, given validation records or a usable_ids.json (dict or path)."""
    if isinstance(validation, str | Path):
        validation = dict(json.loads(Path(validation).read_text()))
    if isinstance(validation, Mapping):
        keep = set(validation[criterion])
        margin = float(validation["margin"])
        reasons = {i.item_id: "not_usable" for i in items if i.item_id not in keep}
    else:
        rows: dict[str, Mapping[str, Any]] = {str(r["item_id"]): r for r in validation}
        keep = {i for i, r in rows.items() if r[f"usable_{criterion}"]}
        margin = float(summarize(list(rows.values()))["margin"]) if rows else math.nan
        reasons = {i: str(r[f"skip_{criterion}"]) for i, r in rows.items() if i not in keep}
    kept = [it for it in items if it.item_id in keep]
    skipped = Counter(reasons.get(it.item_id, "not_validated") for it in items if it.item_id not in keep)
    return Selection(kept, criterion, margin, len(items), dict(skipped))
