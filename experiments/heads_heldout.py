"""Experiment `heads_heldout`: read heads ranked by their effect on the *other* items.

Probe `knockout` ranks read heads two ways: by the decision token's attention to the notes (the
paper's ranking) and by each head's own patching effect on the same item. The second is an
in-sample upper bound: the ranking and its evaluation share the item. Here the ranking is
cross-fitted, in two phases over the same items:

1. `single-<item>`: every head's own recovery on each usable item (its output at the decision
   token patched new -> old, the rest of the old run unchanged): `head_single` records;
2. `curve-<item>`: once every item's single effects exist, the item's heads are ranked by their
   mean single recovery over the *other* usable items (leave one item out: `effect_heldout`),
   and patched k at a time beside the attention ranking, the in-sample effect ranking and
   random heads (probes.parts.heads), k in `head_ks`.

Reading: if `effect_heldout` tracks `effect`, the heads that carry the decision are the same on
every item and a ranking that never sees the item finds them; if it falls toward `attention` or
random, the in-sample curve was item-specific. `heldout_minus_attention` and
`effect_minus_heldout` at k = n_heads are paired per item with bootstrap CIs.

    python -m experiments.run +experiment=heads_heldout model=qwen-1.5b task=gated task.n_items=60
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvnotes.edit.patching import PatchPair, make_pair
from probes.parts.common import (
    attention_to_cache,
    margin_rule,
    pair_fields,
    resolve_margin,
    skip_reason,
    skip_summary,
    skipped_record,
)
from probes.parts.heads import all_heads, head_records, rank_heads, single_effects, summarize_heads
from probes.parts.readouts import paired_difference, per_item

if TYPE_CHECKING:
    from experiments.shared.context import Context

log = logging.getLogger(__name__)
RANKINGS = ["attention", "effect", "effect_heldout"]


@dataclass
class HeadsHeldoutConfig:
    margin: float | None = None
    head_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    n_heads: int = 12  # the paper's top-12: always on the curve, and compared on its own
    n_random: int = 3
    seed: int = 0
    batch_size: int = 64

    def __post_init__(self) -> None:
        if not self.head_ks or any(k < 1 for k in self.head_ks) or self.n_heads < 1:
            raise ValueError("head_ks (non-empty) and n_heads must be >= 1")
        if self.n_random < 0 or self.batch_size < 1:
            raise ValueError("n_random >= 0 and batch_size >= 1")


def heldout_orders(single: Sequence[Mapping[str, Any]], n_layers: int, n_heads: int
                   ) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """item -> {"effect": its own ranking, "effect_heldout": ranked by the mean over the others}."""
    every = all_heads(n_layers, n_heads)
    index = {h: i for i, h in enumerate(every)}
    items = sorted({str(r["item_id"]) for r in single})
    eff = np.full((len(items), len(every)), np.nan)
    row = {item: i for i, item in enumerate(items)}
    for r in single:
        eff[row[str(r["item_id"])], index[(int(r["layer"]), int(r["head"]))]] = float(r["recovery"])
    total, count = np.nansum(eff, axis=0), np.sum(~np.isnan(eff), axis=0)
    out = {}
    for item, i in row.items():
        own = np.nan_to_num(eff[i], nan=0.0)
        n_other = count - (~np.isnan(eff[i])).astype(int)
        with np.errstate(invalid="ignore", divide="ignore"):
            others = np.where(n_other > 0, (total - own) / n_other, np.nan)
        out[item] = {"effect": rank_heads(eff[i], every), "effect_heldout": rank_heads(others, every)}
    return out


def _at(records: Sequence[Mapping[str, Any]], ranking: str, k: int) -> dict[str, float]:
    return per_item(records, lambda r: r.get("condition") == "heads" and r["ranking"] == ranking
                    and int(r["n_heads"]) == k, "recovery")


def summarize(records: Sequence[Mapping[str, Any]], cfg: HeadsHeldoutConfig) -> dict[str, Any]:
    out = skip_summary(records)
    out["heads"] = summarize_heads(records, cfg.n_heads)
    k = cfg.n_heads
    held, own, att = (_at(records, rk, k) for rk in ("effect_heldout", "effect", "attention"))
    out[f"heldout_minus_attention_k{k}"] = paired_difference(held, att)
    out[f"effect_minus_heldout_k{k}"] = paired_difference(own, held)
    out["n_curve_items"] = len(held)
    return out


def _base(pair: PatchPair, margin: float, rule: str) -> dict[str, Any]:
    """The fields every record of one usable item carries."""
    return pair_fields(pair, margin) | {"margin_rule": rule}


def run(ctx: Context) -> None:
    cfg: HeadsHeldoutConfig = ctx.params
    model = ctx.model
    margin, rule = resolve_margin(model, cfg.margin), margin_rule(model, cfg.margin)
    items = {str(it.item_id): it for it in ctx.items()}
    L, H = model.n_layers, int(model.adapter.n_heads(model.hf))
    every = all_heads(L, H)
    for key in ctx.pending([f"single-{i}" for i in items], desc="single-head effects"):
        pair = make_pair(model, items[key.removeprefix("single-")])
        reason = skip_reason(pair, margin)
        if reason:
            ctx.write(key, [skipped_record(pair, margin, reason) | {"margin_rule": rule}])
            continue
        base = _base(pair, margin, rule)
        effects = single_effects(model, pair, cfg.batch_size)
        ctx.write(key, [base | {"condition": "head_single", "layer": layer, "head": head, "recovery": float(e)}
                        for (layer, head), e in zip(every, effects, strict=True)])
    done = ctx.read()
    single = done[done["condition"] == "head_single"].to_dict("records") if len(done) else []
    orders = heldout_orders(single, L, H)
    if len(orders) < 2:
        log.warning("heads_heldout: %d usable item(s); a held-out ranking needs at least 2", len(orders))
        return
    ks = sorted(set(cfg.head_ks) | {cfg.n_heads})
    for key in ctx.pending([f"curve-{i}" for i in sorted(orders)], desc="head curves"):
        item_id = key.removeprefix("curve-")
        pair = make_pair(model, items[item_id])
        base = _base(pair, margin, rule)
        rng = random.Random(f"{cfg.seed}/{item_id}")
        ctx.write(key, head_records(model, pair, attention_to_cache(model, pair), ks, RANKINGS, cfg.n_random,
                                    rng, base, cfg.batch_size, given=orders[item_id]))


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "heads_heldout"
CONFIG = HeadsHeldoutConfig
HELP = "read heads ranked by their effect on the other items (cross-fitted), beside attention and in-sample"
