"""Experiment `distance`: does the decision read the field directly, or notes, as it moves away?

Each item of the configured gated suite (`task=<suite>`, `task.n_items` of them) is rendered at
every distance d (tokens from the last field token to the decision token, kvnotes.tasks.distance:
same draws and total length at every d, only the field moves). Per item and distance: the stale
(old prompt) and oracle (new prompt) scores, delta = score_new - score_old, usable when
|delta| >= margin, and for usable items the locality patches of the `patching` probe:

    field-only  = recovery with the field's own K/V from the new run (everything after it stale)
    notes-only  = recovery with every position after the field from the new run, the field stale

recovery = (score - stale) / (oracle - stale). Near the decision the last token can attend to
the field itself (field-only high); far from it, the paper's account says the conclusion is
memoised in downstream notes (field-only ~ 0, notes-only ~ 1). The summary gives per distance
n, usable share (Wilson interval), mean |delta| and both recoveries (bootstrap CIs over items).

A confound: against `gated`, this layout changes two things besides the distance. The field
follows the rule (in `gated` it precedes it) and only neutral filler follows the field (in
`gated` the rule, demonstrations and request do). Field-only ~0.85 here against ~0.03 in `gated`
at similar lengths can come from either; experiments/order.py crosses order x content x distance.

    python -m experiments.run +experiment=distance model=llama task=gated task.n_items=12
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from experiments.shared.layouts import check_patch_settings, layout_items
from kvnotes.edit.patching import make_pair, patched_scores, recoveries
from kvnotes.errors import ConfigError
from kvnotes.measure import margins
from kvnotes.measure.metrics import ci_dict, wilson_ci
from kvnotes.measure.timing import check_fits
from kvnotes.tasks.distance import build_distance_suite, pair_id
from kvnotes.tasks.item import TaskItem

if TYPE_CHECKING:
    from experiments.shared.context import Context
    from kvnotes.edit.patching import PatchPair
    from kvnotes.models import LoadedModel

log = logging.getLogger(__name__)

CONDITIONS = ("field_only", "notes_only", "full_downstream")
MAX_DISTANCE = 8000


@dataclass
class DistanceConfig:
    """Distances in tokens (field end to decision); `length` is every prompt's total (the task
    config's `length` is not used: each distance needs its own split of the filler)."""

    distances: list[int] = field(default_factory=lambda: [32, 64, 128, 256, 512, 1024])
    length: int | None = None  # None: per item, the shortest that fits the longest distance
    margin: float | None = None  # None: the model config's margin
    batch_size: int | None = None  # patched variants per forward; None: as many as half the free memory holds
    n_boot: int = 1000

    def __post_init__(self) -> None:
        ds = list(self.distances)
        if not ds or any(int(d) != d or d < 1 for d in ds) or len(set(ds)) != len(ds):
            raise ConfigError(f"distances must be distinct ints >= 1, got {ds}")
        if max(ds) > MAX_DISTANCE:
            raise ConfigError(f"distances up to {MAX_DISTANCE} tokens (the filler bank's tested range), got {max(ds)}")
        if self.length is not None and self.length < 1:
            raise ConfigError(f"length must be >= 1 or null, got {self.length}")
        check_patch_settings(self.margin, self.batch_size, self.n_boot)


def item_record(pair: PatchPair, recs: Sequence[float] | None, margin: float) -> dict[str, Any]:
    """One record per item and distance; recoveries NaN (with the reason) when not usable."""
    it = pair.item
    reason = margins.unusable(pair.delta, margin)
    usable = reason is None
    rec = dict(zip(CONDITIONS, recs if recs is not None else [math.nan] * len(CONDITIONS), strict=True))
    return {
        "item_id": it.item_id, "pair_id": pair_id(it), "suite": it.suite, "domain": it.domain,
        "template_id": it.template_id, "n_tokens": it.n_tokens, "field_start": it.field_span[0],
        "field_end": it.field_span[1], "distance": int(it.meta["distance"]),
        "distance_tokens": int(it.meta["distance_tokens"]), "margin": margin,
        "score_stale": pair.score_stale, "score_oracle": pair.score_oracle, "delta": pair.delta,
        "abs_delta": abs(pair.delta), "usable": usable,
        "skip_reason": reason,
        **{k: float(v) for k, v in rec.items()},
    }


def measure(model: LoadedModel, item: TaskItem, margin: float, batch_size: int | None = None) -> dict[str, Any]:
    """Stale/oracle pair of one item and, when usable, its field-only / notes-only recoveries."""
    pair = make_pair(model, item)
    if margins.unusable(pair.delta, margin):
        return item_record(pair, None, margin)
    states = [pair.field_positions, pair.downstream_positions, pair.field_to_end]
    scores = patched_scores(model, pair, states, batch_size=batch_size)
    return item_record(pair, list(recoveries(pair, scores)), margin)


def summarize(records: Sequence[Mapping[str, Any]], cfg: DistanceConfig) -> dict[str, Any]:
    """Per distance: n, usable share (Wilson), mean |delta|, field-only and notes-only recovery
    over usable items, and their paired difference notes - field (bootstrap CIs)."""
    rows = [r for r in records if "distance" in r]
    per: dict[str, Any] = {}
    for d in sorted({int(r["distance"]) for r in rows}):
        sel = [r for r in rows if int(r["distance"]) == d]
        use = [r for r in sel if bool(r["usable"])]
        p, lo, hi = wilson_ci(len(use), len(sel))
        per[str(d)] = {
            "distance": d,
            "n": len(sel),
            "n_usable": len(use),
            "distance_tokens": ci_dict((r["distance_tokens"] for r in sel), cfg.n_boot),
            "usable_share": {"mean": p, "ci_lo": lo, "ci_hi": hi, "n": len(sel)},
            "abs_delta": ci_dict((r["abs_delta"] for r in sel), cfg.n_boot),
            **{c: ci_dict((r[c] for r in use), cfg.n_boot) for c in CONDITIONS},
            "notes_minus_field": ci_dict((r["notes_only"] - r["field_only"] for r in use), cfg.n_boot),
        }
    margins = sorted({float(r["margin"]) for r in rows})
    out: dict[str, Any] = {"margin": margins[0] if len(margins) == 1 else margins,
                           "n_items": len({r["pair_id"] for r in rows}), "per_distance": per}
    if rows and not any(bool(r["usable"]) for r in rows):
        out["note"] = (f"no item is usable at margin {out['margin']} at any distance: the model's "
                       "decision barely depends on the field; try a larger model (qwen-1.5b)")
    return out


def build_items(ctx: Context) -> list[TaskItem]:
    """Every (item, distance) of the task suite for this model's tokenizer; bad distances or
    lengths fail here, before any forward pass, in one line."""
    params: DistanceConfig = ctx.params
    return layout_items(ctx, "distance", build_distance_suite, "smaller distances",
                        distances=params.distances, length=params.length)


def run(ctx: Context) -> None:
    params: DistanceConfig = ctx.params
    margin = float(ctx.model.margin if params.margin is None else params.margin)
    items = {f"item-{it.item_id}": it for it in build_items(ctx)}
    longest = max((it.n_tokens for it in items.values()), default=0)
    if longest:  # these prompts, not the task's length, set the peak: checked before any forward
        log.info("distance prompts up to %d tokens (the task's length is not used): %s", longest,
                 check_fits(ctx.model, longest))
    for key in ctx.pending(list(items), desc="distance items"):
        ctx.write(key, [measure(ctx.model, items[key], margin, params.batch_size)])


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "distance"
CONFIG = DistanceConfig
HELP = "field-decision distance sweep: |delta|, usable share, field-only / notes-only recovery"
