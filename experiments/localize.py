"""Experiment `localize`: where the notes are, ranked on held-out items (issue 31, item 2).

Two phases over the usable items of a suite, as `heads_heldout` does for heads:

1. `map-<item>`: the exact per-position patching map (one downstream position, all layers, new
   K/V into the old run; recovery = (score - stale) / (oracle - stale)), with `bands=true` also
   per layer third (early / mid / late); each position stamped with its alignment key, its prompt
   segment, its token class and whether it lies in the most-attended quarter of the downstream
   span (the decision token's attention on the new cache: probes.parts.common.attended_positions,
   the scrub probe's `attended` set).
2. `sets-<item>`: the item's positions ranked by the mean effect of the *corresponding* positions
   on the *other* usable items of its group (leave one out: the item's own map never enters its
   ranking; `heldout`), then patched jointly as nested top-k sets, k = 1..k_scan one at a time
   (so the smallest k recovering `threshold` is exact up to k_scan) and doubling beyond it; beside
   it the ranking on the item's own map (`in_sample`, an upper bound) and random sets at `ks`,
   both over the same aligned positions. Positions are downstream of the field only (the field's
   own K/V is the field-only condition of probe `patching`; upstream K/V is identical in both runs).

Alignment across items. Items of one template (a gated suite) share the frame: the same segments
in the same order (TaskItem.segments: session, policy, tools, turn_user, rule, examples, request,
task, turn_answer, answer_prefix), differing in the domain's words, the filler and the field value.
A downstream position p is keyed (segment, offset): with `align=both` (default) the offset counts
from the segment's start in its first half (+i) and from its end in its second half (-j, the last
token is -1), so the segment's opening words and its closing newline/colon align across items
whatever the segment's length; `start` or `end` key every offset one way. The segment holding the
field is cut at the field's end (its offsets count from the token after the field). What fails to
align: a position in no segment, and a key that no other item of the group has (a longer rule's
middle, a longer filler policy); those are left out of the ranking and counted (`n_unaligned`).
Offsets in the middle of content segments (policy filler, rule, request) align by place, not by
word. Token class: `token_class`, aggregator (newline, punctuation, section mark, special token;
TaskItem.aggregators, the definition the scrub probe reads) or content.

Hypothesis, written before any run: the smallest held-out set recovering 0.8 is at most 16
positions on most items (more than half reach it with k <= 16; an item that never reaches 0.8
counts as more), top-8 held-out recovers within 0.15 of the in-sample
top-8, and the k80 set lies mostly (> 50 %) in the most-attended quarter of the downstream span and
not mainly in aggregator tokens (aggregator share < 50 %). Refuted by: median k80 > 16 or most items
never reaching 0.8 with held-out sets (the notes are item-specific or spread out; in-sample sets
then only fit each item); a held-out top-8 far below in-sample (> 0.15 apart: the place is not
shared across items); or a k80 set mainly of aggregator tokens (the paper's picture, against scrub).

    python -m experiments.run +experiment=localize model=qwen-1.5b task=gated task.n_items=60
"""

from __future__ import annotations

import logging
import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pandas as pd

from experiments.shared.localize_summary import summarize_sets
from kvnotes.edit.patching import PatchPair, make_pair, patched_scores, recoveries
from kvnotes.pairs.localize import heldout_order, position_keys, scan_ks
from kvnotes.tasks.item import TaskItem
from probes.parts.common import (
    attended_positions,
    attention_to_cache,
    bands,
    margin_rule,
    pair_fields,
    resolve_margin,
    skip_reason,
    skip_summary,
    skipped_record,
    token_texts,
)

if TYPE_CHECKING:
    from experiments.shared.context import Context

log = logging.getLogger(__name__)
ALIGN = ("both", "start", "end")
GROUPS = ("suite", "domain", "template_id")
Key = tuple[str, int]
K = TypeVar("K", bound=Hashable)


@dataclass
class LocalizeConfig:
    margin: float | None = None  # None: the model config's margin
    ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    k_scan: int = 64  # held-out sets k = 1..k_scan one by one (smallest k exact), then doubling
    threshold: float = 0.8  # the recovery a smallest set must reach
    align: str = "both"  # both | start | end: how offsets within a segment are counted
    group: str = "suite"  # the items a ranking is learned from: same suite | domain | template_id
    bands: bool = False  # also position x layer third (early / mid / late): 4x the patches
    n_random: int = 1  # random sets per k (the control)
    seed: int = 0
    paper_top8: list[float] = field(default_factory=lambda: [0.74, 0.79])  # paper_reference.yaml top8_recovery
    batch_size: int | None = None  # patched variants per forward; None: from the free memory
    n_boot: int = 2000

    def __post_init__(self) -> None:
        if not self.ks or any(k < 1 for k in self.ks) or self.k_scan < 1:
            raise ValueError(f"ks (non-empty) and k_scan must be >= 1, got ks={self.ks}, k_scan={self.k_scan}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.align not in ALIGN:
            raise ValueError(f"align must be one of {', '.join(ALIGN)}, got {self.align!r}")
        if self.group not in GROUPS:
            raise ValueError(f"group must be one of {', '.join(GROUPS)}, got {self.group!r}")
        if self.n_random < 0 or (self.batch_size is not None and self.batch_size < 1) or self.n_boot < 1:
            raise ValueError("n_random >= 0, batch_size >= 1 (or null) and n_boot >= 1")
        if len(self.paper_top8) != 2 or self.paper_top8[0] > self.paper_top8[1]:
            raise ValueError(f"paper_top8 is a range [lo, hi], got {self.paper_top8}")


# --- positions: segment, alignment key, token class -----------------------------------------------

def segment_names(item: TaskItem) -> list[str]:
    """The segment of every prompt position ('field' inside the field span, 'other' outside all)."""
    out = ["other"] * item.n_tokens
    for name, (a, b) in item.segments.items():
        out[a:b] = [name] * (b - a)
    s, e = item.field_span
    out[s:e] = ["field"] * (e - s)
    return out


def key_text(key: Key) -> str:
    return f"{key[0]}:{key[1]:+d}"


def token_class(item: TaskItem, pos: int) -> str:
    """`aggregator` (newline, punctuation, section mark or special token after the field:
    TaskItem.aggregators, kvnotes.tasks.tokens.is_aggregator) or `content`."""
    return "aggregator" if pos in set(item.aggregators) else "content"


# --- rankings ------------------------------------------------------------------------------------

def heldout_orders(maps: Mapping[str, Mapping[K, float]], keys: Mapping[str, Mapping[int, K]],
                   groups: Mapping[str, str]) -> dict[str, tuple[list[int], list[int]]]:
    """item -> heldout_order over the other items of its group (items alone in theirs: absent)."""
    out = {}
    for item, k in keys.items():
        others = [maps[j] for j in maps if j != item and groups[j] == groups[item]]
        if others:
            out[item] = heldout_order(k, others)
    return out


def in_sample_order(own: Mapping[int, float], candidates: Sequence[int]) -> list[int]:
    """The candidates by the item's own single-position effect (the in-sample upper bound)."""
    return sorted(candidates, key=lambda p: (-float(np.nan_to_num(own.get(p, np.nan), nan=-np.inf)), p))


# --- the two phases ------------------------------------------------------------------------------

def _base(pair: PatchPair, margin: float, rule: str) -> dict[str, Any]:
    """The fields every record of one usable item carries."""
    return pair_fields(pair, margin) | {"margin_rule": rule}


def band_layers(n_layers: int, with_bands: bool) -> dict[str, list[int]]:
    b = bands(n_layers)
    return b if with_bands else {"all": b["all"]}


def map_records(ctx: Context, pair: PatchPair, base: dict[str, Any]) -> list[dict[str, Any]]:
    """Phase 1 of one usable item: its tokens and segments, then the per-position map per band."""
    cfg: LocalizeConfig = ctx.params
    model, item = ctx.model, pair.item
    keys = position_keys(item, pair.n_cached, cfg.align)
    down = pair.downstream_positions
    attended = set(attended_positions(pair, attention_to_cache(model, pair), 0.25))
    segs = segment_names(item)
    tokens = token_texts(model, item.old_ids)
    out = [base | {"condition": "tokens", "tokens": tokens, "segments": segs, "n_cached": pair.n_cached}]
    for band, layers in band_layers(model.n_layers, cfg.bands).items():
        s = patched_scores(model, pair, [[p] for p in down], [layers] * len(down), batch_size=cfg.batch_size)
        out += [base | {"condition": "position", "band": band, "position": p, "token": tokens[p],
                        "segment": segs[p], "key": key_text(keys[p]) if p in keys else None,
                        "token_class": token_class(item, p), "attended": p in attended,
                        "recovery": float(r)}
                for p, r in zip(down, recoveries(pair, s), strict=True)]
    return out


def set_records(ctx: Context, pair: PatchPair, base: dict[str, Any], band: str, layers: list[int],
                ranked: list[int], unaligned: list[int], own: Mapping[int, float],
                attended: set[int]) -> list[dict[str, Any]]:
    """Phase 2 of one item and band: nested held-out sets over the scan, in-sample and random at ks."""
    cfg: LocalizeConfig = ctx.params
    item, n = pair.item, len(ranked)
    if not n:
        return []
    segs = segment_names(item)
    rng = random.Random(f"{cfg.seed}/{item.item_id}/{band}")
    plans: list[tuple[str, int, int, list[int]]] = []  # (ranking, draw, k, positions)
    for k in scan_ks(cfg.k_scan, n):
        plans.append(("heldout", 0, k, ranked[:k]))
    inside = in_sample_order(own, ranked)
    for k in sorted(k for k in set(cfg.ks) if k <= n):
        plans.append(("in_sample", 0, k, inside[:k]))
        plans += [("random", d, k, sorted(rng.sample(ranked, k))) for d in range(cfg.n_random)]
    s = patched_scores(ctx.model, pair, [p for *_, p in plans], [layers] * len(plans), batch_size=cfg.batch_size)
    out, prev = [], 0
    for (ranking, draw, k, pos), r in zip(plans, recoveries(pair, s), strict=True):
        row = base | {"condition": "set", "ranking": ranking, "draw": draw, "band": band, "k": k,
                      "recovery": float(r), "n_ranked": n, "n_unaligned": len(unaligned)}
        if ranking == "heldout":  # sets nest: the positions this k adds to the one before
            added = ranked[prev:k]
            prev = k
            row |= {"added": added, "added_segments": [segs[p] for p in added],
                    "added_classes": [token_class(item, p) for p in added],
                    "added_attended": [p in attended for p in added]}
        else:
            row["positions"] = pos
        out.append(row)
    return out


def run(ctx: Context) -> None:
    cfg: LocalizeConfig = ctx.params
    model = ctx.model
    margin, rule = resolve_margin(model, cfg.margin), margin_rule(model, cfg.margin)
    items = {str(it.item_id): it for it in ctx.items()}
    for key in ctx.pending([f"map-{i}" for i in items], desc="per-position maps"):
        pair = make_pair(model, items[key.removeprefix("map-")])
        reason = skip_reason(pair, margin)
        ctx.write(key, [skipped_record(pair, margin, reason) | {"margin_rule": rule}] if reason
                  else map_records(ctx, pair, _base(pair, margin, rule)))
    done = ctx.read()
    pos = done[done["condition"] == "position"] if len(done) else done
    if not len(pos):
        log.warning("localize: no usable item; nothing to rank")
        return
    group = pos.groupby("item_id")[cfg.group].first().astype(str).to_dict()
    todo = [i for i in sorted(group) if sum(g == group[i] for g in group.values()) > 1]
    if len(todo) < len(group):
        log.warning("localize: %d usable item(s) alone in their %s; no held-out ranking for them",
                    len(group) - len(todo), cfg.group)
    layer_sets = band_layers(model.n_layers, cfg.bands)
    plans = {band: band_plan(pos[pos["band"] == band], group) for band in layer_sets}
    for key in ctx.pending([f"sets-{i}" for i in todo], desc="held-out sets"):
        item_id = key.removeprefix("sets-")
        pair = make_pair(model, items[item_id])
        base = _base(pair, margin, rule)
        out: list[dict[str, Any]] = []
        for band, layers in layer_sets.items():
            ranked, unaligned, own, attended = plans[band][item_id]
            out += set_records(ctx, pair, base, band, layers, ranked, unaligned, own, attended)
        ctx.write(key, out)


def band_plan(rows: pd.DataFrame, group: Mapping[str, str]
              ) -> dict[str, tuple[list[int], list[int], dict[int, float], set[int]]]:
    """item -> (held-out ranking, unaligned positions, own map, attended positions) from one band's
    `position` records; the ranking comes from heldout_orders, which leaves the item out."""
    maps: dict[str, dict[str, float]] = {}
    keys: dict[str, dict[int, str]] = {}
    out = {}
    for i, g in rows.groupby("item_id"):
        aligned = g[g["key"].notna()]
        maps[str(i)] = dict(zip(aligned["key"].astype(str), aligned["recovery"].astype(float), strict=True))
        keys[str(i)] = dict(zip(aligned["position"].astype(int), aligned["key"].astype(str), strict=True))
    orders = heldout_orders(maps, keys, group)
    for i, g in rows.groupby("item_id"):
        if str(i) not in orders:
            continue
        ranked, unaligned = orders[str(i)]
        unaligned = sorted(unaligned + [int(p) for p in g.loc[g["key"].isna(), "position"]])
        own = dict(zip(g["position"].astype(int), g["recovery"].astype(float), strict=True))
        out[str(i)] = (ranked, unaligned, own, set(g.loc[g["attended"].astype(bool), "position"].astype(int)))
    return out


def summarize(records: Sequence[Mapping[str, Any]], cfg: LocalizeConfig) -> dict[str, Any]:
    return skip_summary(records) | summarize_sets(records, cfg.ks, cfg.threshold, cfg.paper_top8, cfg.n_boot)


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "localize"
CONFIG = LocalizeConfig
READS_TASK = True  # builds the task group's items: the runner checks task.length before loading
HELP = "where the notes are: positions ranked on the other items of the template, nested top-k sets, smallest set to 0.8"
