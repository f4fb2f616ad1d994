"""Experiment `order`: does field/rule order, or what follows them, decide where the conclusion is kept?

The distance sweep (experiments/distance.py) put the field after the rule with only filler after
it and found field-only recovery ~0.85 at every distance, against ~0.03 in `gated` (field before
the rule, demonstrations and request after both): it changed order and downstream content
together. Here each item of a gated field suite is rendered in 2 x 2 x S cells
(kvnotes.tasks.order): field line before / after the rule; the stretch between the later of the
two and the task line holding task content (demonstrations, request) or neutral filler; the
stretch ~64, 256, 1024 tokens. Per item and cell, as in `distance`: stale and oracle scores,
delta = score_new - score_old, usable when |delta| >= margin, and for usable items

    field-only = recovery with the field's own K/V from the new run (everything after it stale)
    notes-only = recovery with every position after the field from the new run, the field stale

recovery = (score - stale) / (oracle - stale), read through the patching probe's machinery
(probes.parts.common.run_pairs, kvnotes.edit.patching).

Hypothesis, written before any order run was read (docs/order.md states it in full):
H1: the conclusion is first written at the first positions that see both field and rule, and
the decision reads its latest copy upstream of it; task content after both restates it, filler
does not. Predicted carrier per (order, content), at every stretch: field_before_rule/task notes,
field_before_rule/filler notes (the first positions seeing both are the rule's, after the field),
field_after_rule/filler field, field_after_rule/task notes. A cell's carrier is `field` when
notes-only minus field-only has its 95 % CI below 0, `notes` when above 0, with at least
MIN_USABLE usable items. H1 is refuted for an (order, content) pair when the opposite carrier is
determined at more than half of its stretches; field_before_rule/filler read `field` would favour
the rival H2 (the decision reads the field unless task content follows), field_after_rule/task
read `field` the rival H1' (first sight only, no restating).

    python -m experiments.run +experiment=order model=llama task=gated experiment.n_items=4
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from experiments.shared.layouts import check_patch_settings, layout_items
from kvnotes.edit.patching import PatchPair, patched_scores, recoveries
from kvnotes.errors import ConfigError
from kvnotes.measure.metrics import ci_dict, cluster_bootstrap_ci, prop_dict, wider
from kvnotes.measure.timing import check_fits
from kvnotes.tasks.distance import pair_id
from kvnotes.tasks.item import TaskItem
from kvnotes.tasks.order import (
    CONTENTS,
    MAX_STRETCH,
    ORDERS,
    PLACES,
    build_order_suite,
    check_stretches,
)
from probes.parts.common import pair_fields, run_pairs

if TYPE_CHECKING:
    from experiments.shared.context import Context
    from kvnotes.models import LoadedModel

log = logging.getLogger(__name__)

CONDITIONS = ("field_only", "notes_only", "full_downstream")
MIN_USABLE = 12  # half of the >= 24 usable items per cell the reference run aims at
PREDICTED = {"field_before_rule/task": "notes", "field_before_rule/filler": "notes",
             "field_after_rule/filler": "field", "field_after_rule/task": "notes"}  # H1, before any run
OPPOSITE = {"field": "notes", "notes": "field"}
INTERVALS = ("95 % percentile bootstrap over items (means) and Wilson (usable share); beside each "
             "recovery and the notes-minus-field difference a cluster bootstrap over domains "
             "(`ci_cluster`: items of one domain share its templates), and the carrier is read from "
             "the wider of the two intervals")
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass
class OrderConfig:
    """The design's stretches and its size; the task config's `length` is not used (each cell has
    its own) and neither is `task.n_items` unless `n_items` is null."""

    stretches: list[int] = field(default_factory=lambda: [64, 256, 1024])
    n_items: int | None = 32  # items per cell (each item is rendered in every cell); None: task.n_items
    content_at: str = "end"  # where task content sits in its stretch: end (next to the task line) | start
    equal_length: bool = False  # pad every cell of an item to its longest (else: cells of one stretch)
    margin: float | None = None  # None: the model config's margin
    batch_size: int | None = None  # patched variants per forward; None: as many as half the free memory holds
    n_boot: int = 1000

    def __post_init__(self) -> None:
        try:
            check_stretches(self.stretches)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.n_items is not None and self.n_items < 1:
            raise ConfigError(f"n_items must be >= 1 or null (task.n_items), got {self.n_items}")
        if self.content_at not in PLACES:
            raise ConfigError(f"content_at must be one of {PLACES}, got {self.content_at!r}")
        check_patch_settings(self.margin, self.batch_size, self.n_boot)


def cell_fields(item: TaskItem) -> dict[str, Any]:
    m = item.meta
    return {"pair_id": pair_id(item), "index": int(m["index"]), "order": m["order"], "content": m["content"],
            "cell": f"{m['order']}/{m['content']}/{m['stretch']}", "stretch": int(m["stretch"]),
            "stretch_tokens": int(m["stretch_tokens"]), "distance_tokens": int(m["distance_tokens"]),
            "later_end": int(m["later_end"]), "content_at": m["place"]}


def measure(model: LoadedModel, item: TaskItem, margin: float | None, batch_size: int | None = None
            ) -> dict[str, Any]:
    """One record of one item in one cell: scores, |delta|, usable, and when usable the recoveries."""

    def usable(pair: PatchPair, m: float) -> list[dict[str, Any]]:
        states = [pair.field_positions, pair.downstream_positions, pair.field_to_end]
        rec = recoveries(pair, patched_scores(model, pair, states, batch_size=batch_size))
        return [pair_fields(pair, m) | {"usable": True, "skip_reason": None}
                | {c: float(r) for c, r in zip(CONDITIONS, rec, strict=True)}]

    (rec,) = run_pairs(model, [item], margin, usable)
    if rec.pop("condition", None) == "skipped":
        rec = rec | {"usable": False, "skip_reason": rec.pop("reason")} | dict.fromkeys(CONDITIONS, math.nan)
    delta = float(rec["score_oracle"]) - float(rec["score_stale"])
    return rec | cell_fields(item) | {"delta": delta, "abs_delta": abs(delta)}


def carrier(notes_minus_field: Mapping[str, Any], n_usable: int) -> str:
    """field | notes | neither (CI spans 0) | undetermined (fewer than MIN_USABLE usable items),
    from the wider of the item interval and the domain-cluster one (`ci_cluster`) when present."""
    d = wider(notes_minus_field, notes_minus_field.get("ci_cluster") or {})
    lo, hi = float(d.get("ci_lo", math.nan)), float(d.get("ci_hi", math.nan))
    if n_usable < MIN_USABLE or not (math.isfinite(lo) and math.isfinite(hi)):
        return "undetermined"
    return "notes" if lo > 0 else "field" if hi < 0 else "neither"


def _distribution(values: Sequence[float]) -> dict[str, Any]:
    x = np.asarray([v for v in values if math.isfinite(v)], dtype=np.float64)
    if not x.size:
        return {"n": 0}
    return {"n": int(x.size), "min": float(x.min()), "max": float(x.max()),
            **{f"q{int(q * 100):02d}": float(np.quantile(x, q)) for q in QUANTILES}}


def _cell(sel: Sequence[Mapping[str, Any]], n_boot: int, units: bool = False) -> dict[str, Any]:
    """n, usable share, |delta| and recoveries of some records; `units`: an item's rows averaged."""
    use = [r for r in sel if bool(r["usable"])]

    def ci(rows: Sequence[Mapping[str, Any]], f: Any) -> dict[str, Any]:
        return ci_dict([float(f(r)) for r in rows], n_boot, units=[r["pair_id"] for r in rows] if units else None)

    def clustered(rows: Sequence[Mapping[str, Any]], f: Any) -> dict[str, Any]:
        """ci() with a domain-cluster interval beside it (an item's rows averaged first when pooled)."""
        per: dict[str, list[float]] = {}
        domain: dict[str, str] = {}
        for r in rows:
            key = str(r["pair_id"])  # one row per item in a cell; an item's rows when pooled
            per.setdefault(key, []).append(float(f(r)))
            domain[key] = str(r["domain"])
        keys = sorted(per)
        vals = [float(np.mean(per[k])) for k in keys]
        return ci(rows, f) | {"ci_cluster": cluster_bootstrap_ci(vals, [domain[k] for k in keys], n_boot)}

    out: dict[str, Any] = {
        "n": len(sel), "n_usable": len(use), "n_domains": len({r["domain"] for r in sel}),
        # per cell one 0/1 outcome per item (Wilson); pooled over stretches, an item's share (bootstrap)
        "usable_share": ci(sel, lambda r: bool(r["usable"])) if units else prop_dict([bool(r["usable"]) for r in sel]),
        "abs_delta": ci(sel, lambda r: r["abs_delta"]) | {"distribution": _distribution([r["abs_delta"] for r in sel])},
        **{c: clustered(use, lambda r, c=c: r[c]) for c in CONDITIONS},
        "notes_minus_field": clustered(use, lambda r: r["notes_only"] - r["field_only"]),
    }
    for c in ("field_only", "notes_only"):
        out[c]["distribution"] = _distribution([r[c] for r in use])
    return out


def summarize(records: Sequence[Mapping[str, Any]], cfg: OrderConfig) -> dict[str, Any]:
    """Per cell: n, usable share (Wilson), |delta| (mean, CI, quantiles), field-only, notes-only and
    their paired difference over usable items (bootstrap CIs), the carrier and H1's prediction;
    per (order, content) the same pooled over stretches and H1's verdict."""
    rows = [r for r in records if "order" in r]
    per_cell: dict[str, Any] = {}
    pooled: dict[str, Any] = {}
    for o in ORDERS:
        for c in CONTENTS:
            oc = f"{o}/{c}"
            sel = [r for r in rows if r["order"] == o and r["content"] == c]
            if not sel:
                continue
            found = []
            for s in sorted({int(r["stretch"]) for r in sel}):
                cs = [r for r in sel if int(r["stretch"]) == s]
                d = _cell(cs, cfg.n_boot)
                d |= {"order": o, "content": c, "stretch": s,
                      "stretch_tokens": _distribution([r["stretch_tokens"] for r in cs]),
                      "n_tokens": _distribution([r["n_tokens"] for r in cs]),
                      "carrier": carrier(d["notes_minus_field"], d["n_usable"]), "predicted": PREDICTED[oc]}
                per_cell[f"{oc}/{s}"] = d
                found.append(d["carrier"])
            agree = sum(x == PREDICTED[oc] for x in found)
            against = sum(x == OPPOSITE[PREDICTED[oc]] for x in found)
            verdict = ("as predicted" if agree > len(found) / 2 else "against" if against > len(found) / 2
                       else "open")
            pooled[oc] = _cell(sel, cfg.n_boot, units=True) | {
                "carriers_by_stretch": found, "predicted": PREDICTED[oc], "verdict": verdict,
                "carrier_changes_with_stretch": len({x for x in found if x in OPPOSITE}) > 1}
    margins = sorted({float(r["margin"]) for r in rows})
    out: dict[str, Any] = {"margin": margins[0] if len(margins) == 1 else margins,
                           "n_items": len({r["pair_id"] for r in rows}), "intervals": INTERVALS,
                           "min_usable": MIN_USABLE, "per_cell": per_cell, "per_order_content": pooled}
    if rows and not any(bool(r["usable"]) for r in rows):
        out["note"] = (f"no item is usable at margin {out['margin']} in any cell: the model's decision "
                       "barely depends on the field; try a larger model (qwen-1.5b)")
    return out


def build_items(ctx: Context) -> list[TaskItem]:
    """Every (item, cell) of the task suite for this model's tokenizer; bad stretches or suites
    fail here, before any forward pass, in one line."""
    params: OrderConfig = ctx.params
    size = {} if params.n_items is None else {"n_items": params.n_items}
    return layout_items(ctx, "order", build_order_suite, f"smaller stretches (at most {MAX_STRETCH})",
                        stretches=params.stretches, place=params.content_at, equal_length=params.equal_length,
                        **size)


def run(ctx: Context) -> None:
    params: OrderConfig = ctx.params
    items = {f"item-{it.item_id}": it for it in build_items(ctx)}
    longest = max((it.n_tokens for it in items.values()), default=0)
    if longest:  # these prompts, not the task's length, set the peak: checked before any forward
        log.info("order prompts up to %d tokens (the task's length is not used): %s", longest,
                 check_fits(ctx.model, longest))
    for key in ctx.pending(list(items), desc="order items"):
        ctx.write(key, [measure(ctx.model, items[key], params.margin, params.batch_size)])


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "order"
CONFIG = OrderConfig
HELP = "field/rule order x stretch content x stretch length: |delta|, usable share, field-only / notes-only"
