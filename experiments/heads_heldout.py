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

Frozen transfer (`frozen_from: <run dir>`): the heads are chosen once, on another run of the same
model, and tested here without re-ranking. From that run's `head_single` records, `frozen_effect`
orders heads by their mean single recovery over its usable items and `frozen_attention` by their
mean attention to the notes (only when those records carry it); per usable item of this run's
suite (phase `frozen-<item>`, no single-head sweep) their top k are patched beside the item's
own attention ranking (the paper's protocol, which stays the primary number) and random heads.
Hypothesis, written before any run: if the read heads are a property of the model and not of the
`gated` suite, the 12 frozen on `gated` recover on `gated-fresh` at least what each item's own
attention-ranked 12 recover, less 0.1 at most (`frozen_effect_minus_attention_k12` with its CI
above -0.1), and well above random (`frozen_effect_minus_random_k12` with its CI above 0); on
`gated` itself, ranked on the other items, such 12 recovered 0.82 against attention's 0.32 on
qwen-1.5b, so a gap near that one says the heads carry over whole. `gated-trigger` (the trigger
flips, the field stays byte-identical) gets the same numbers with no prediction written for it.

    python -m experiments.run +experiment=heads_heldout model=qwen-1.5b task=gated-fresh task.n_items=48 \
        experiment.frozen_from=results/reference/heads_heldout/qwen-1.5b/2026-12-04_12-10-01
"""

from __future__ import annotations

import ast
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from experiments.shared.run_dirs import run_model_name
from kvnotes.edit.patching import PatchPair, make_pair
from kvnotes.errors import ConfigError
from kvnotes.measure import runfiles
from kvnotes.measure.metrics import ci_dict
from probes.parts.common import (
    attention_to_cache,
    cluster_ci,
    margin_rule,
    pair_fields,
    resolve_margin,
    skip_reason,
    skip_summary,
    skipped_record,
)
from probes.parts.heads import (
    all_heads,
    head_records,
    notes_attention,
    rank_heads,
    single_effects,
    summarize_heads,
)
from probes.parts.readouts import paired_difference, per_item

if TYPE_CHECKING:
    from experiments.shared.context import Context

log = logging.getLogger(__name__)
RANKINGS = ["attention", "effect", "effect_heldout"]
BY = {"frozen_effect": "recovery", "frozen_attention": "attention_to_notes"}  # frozen ranking -> what it ranks by
FROZEN = tuple(BY)


@dataclass
class HeadsHeldoutConfig:
    margin: float | None = None
    head_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    n_heads: int = 12  # the paper's top-12: always on the curve, and compared on its own
    n_random: int = 3
    seed: int = 0
    batch_size: int = 64
    frozen_from: str | None = None  # a run dir of this model: its heads frozen, tested here unranked

    def __post_init__(self) -> None:
        if not self.head_ks or any(k < 1 for k in self.head_ks) or self.n_heads < 1:
            raise ValueError("head_ks (non-empty) and n_heads must be >= 1")
        if self.n_random < 0 or self.batch_size < 1:
            raise ValueError("n_random >= 0 and batch_size >= 1")
        if self.frozen_from is not None and not self.frozen_from.strip():
            raise ValueError("frozen_from is a run directory or null, not empty")

    def check_run(self, run_cfg: Any) -> None:
        """Before any weights load (runner.config.validate): the run frozen_from names is readable,
        of this run's model, and has per-head effects to freeze."""
        if self.frozen_from is not None:
            read_frozen(self.frozen_from, run_cfg.model.name, self.n_heads)


@dataclass(frozen=True)
class FrozenHeads:
    """Head orders fixed on a source run (every head, best first), never re-ranked on this run."""

    run_id: str  # <job>/<model>/<timestamp>: the source run directory's last three parts
    orders: dict[str, list[tuple[int, int]]]  # frozen_effect (and frozen_attention) -> heads
    items: frozenset[str]  # the source's usable items: those with head_single records
    missing: dict[str, str]  # a ranking that could not be frozen -> why


def frozen_orders(single: pd.DataFrame) -> tuple[dict[str, list[tuple[int, int]]], dict[str, str]]:
    """From head_single records: heads best first by their mean over the items of the single
    recovery (frozen_effect) and, where every record carries it, of the attention to the notes
    (frozen_attention); NaN last, ties layer-major. Also why a ranking could not be frozen."""
    layer, head = single["layer"].astype(int), single["head"].astype(int)
    every = sorted(set(zip(layer.tolist(), head.tolist(), strict=True)))  # layer-major
    orders, missing = {}, {}
    for rk, col in BY.items():
        if col not in single or single[col].isna().any():
            have = int(single[col].notna().sum()) if col in single else 0
            missing[rk] = (f"the source's head_single records carry no per-head {col} ({have} of {len(single)} "
                           "rows have it): not recorded there, so not frozen")
            continue
        mean = single.groupby([layer, head])[col].mean()  # one row per item and head: a mean over items
        orders[rk] = rank_heads(np.array([mean.get(h, np.nan) for h in every]), every)
    return orders, missing


def read_frozen(source: str, model_name: str, n_heads: int) -> FrozenHeads:
    """The frozen head orders of run directory `source`; a ConfigError (one line) when it is not a
    finished run, is a run of another model, or has fewer than `n_heads` per-head effects. Read
    once per version of its records (the config check before weights load and the run share it)."""
    try:
        stamp: int | None = (Path(source) / runfiles.RECORDS).stat().st_mtime_ns
    except OSError:
        stamp = None
    return _read_frozen(source, stamp, model_name, n_heads)


@lru_cache(maxsize=4)
def _read_frozen(source: str, stamp: int | None, model_name: str, n_heads: int) -> FrozenHeads:
    where = f"experiment.frozen_from={source!r}"
    path = Path(source)
    if not path.is_dir():
        raise ConfigError(f"{where} is not a directory; give a finished heads_heldout run directory")
    if not (path / runfiles.RECORDS).is_file():
        raise ConfigError(f"{where} has no records.parquet: not a finished run (give a completed heads_heldout run)")
    model = run_model_name(path)
    if model is None:
        raise ConfigError(f"{where}: neither meta.json nor config.yaml names the run's model")
    if model != model_name:
        raise ConfigError(f"{where} is a run of model {model!r}, not {model_name!r}: heads are frozen per model")
    try:
        records = pd.read_parquet(path / runfiles.RECORDS)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: records.parquet cannot be read ({type(e).__name__})") from None
    single = records[records["condition"] == "head_single"] if "condition" in records else records.iloc[:0]
    if single.empty:
        raise ConfigError(f"{where} has no head_single records (per-head effects); freeze heads from a "
                          "heads_heldout run made without frozen_from")
    orders, missing = frozen_orders(single)
    if len(orders["frozen_effect"]) < n_heads:
        raise ConfigError(f"{where} has per-head effects for {len(orders['frozen_effect'])} heads, "
                          f"fewer than n_heads={n_heads}")
    return FrozenHeads("/".join(path.resolve().parts[-3:]), orders,
                       frozenset(str(i) for i in single["item_id"]), missing)


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
    if cfg.frozen_from is not None:
        return summarize_frozen(records, cfg)
    out = skip_summary(records)
    out["heads"] = summarize_heads(records, cfg.n_heads)
    k = cfg.n_heads
    held, own, att = (_at(records, rk, k) for rk in ("effect_heldout", "effect", "attention"))
    out[f"heldout_minus_attention_k{k}"] = paired_difference(held, att)
    out[f"effect_minus_heldout_k{k}"] = paired_difference(own, held)
    out["n_curve_items"] = len(held)
    return out


def summarize_frozen(records: Sequence[Mapping[str, Any]], cfg: HeadsHeldoutConfig) -> dict[str, Any]:
    """Per ranking at k = n_heads the mean recovery over items (bootstrap CI) with the interval of
    resampling whole domains beside it; the paired differences of frozen_effect from the item's own
    attention ranking and from random; the frozen heads and the run they were frozen on."""
    out = skip_summary(records)
    out["heads"] = summarize_heads(records, cfg.n_heads)
    out["heads"].pop("best_single_head_mean")  # no single-head sweep on a frozen run: nothing to report
    k = cfg.n_heads
    rows = [r for r in records if r.get("condition") == "heads" and int(r["n_heads"]) == k]
    rankings = sorted({str(r["ranking"]) for r in rows})
    out[f"recovery_k{k}"] = {rk: ci_dict(_at(records, rk, k).values())
                             | {"ci_cluster": cluster_ci([r for r in rows if r["ranking"] == rk])} for rk in rankings}
    att = _at(records, "attention", k)
    for rk in FROZEN:
        if rk in rankings:
            out[f"{rk}_minus_attention_k{k}"] = paired_difference(_at(records, rk, k), att)
    out[f"frozen_effect_minus_random_k{k}"] = paired_difference(_at(records, "frozen_effect", k),
                                                                _at(records, "random", k))
    heads = {rk: ast.literal_eval(str(next(r["heads"] for r in rows if r["ranking"] == rk)))
             for rk in FROZEN if rk in rankings}
    used = [r for r in records if r.get("condition") == "heads"]
    out["frozen"] = {
        "source_run": sorted({str(r["source_run"]) for r in records if "source_run" in r}),
        "frozen_from": cfg.frozen_from,
        "n_heads": k,
        "heads": {rk: [list(h) for h in hs] for rk, hs in heads.items()},
        "not_frozen": {rk: "the source's head_single records do not carry every head's attention to the "
                       "notes (attention_to_notes: not recorded there), so only frozen_effect is frozen"
                       for rk in FROZEN if rk not in rankings and rows},
        "n_items_in_source": len({r["item_id"] for r in used if r.get("in_source")}),
    }
    out["n_curve_items"] = len(att)
    return out


def _base(pair: PatchPair, margin: float, rule: str) -> dict[str, Any]:
    """The fields every record of one usable item carries."""
    return pair_fields(pair, margin) | {"margin_rule": rule}


def run(ctx: Context) -> None:
    cfg: HeadsHeldoutConfig = ctx.params
    if cfg.frozen_from is not None:
        run_frozen(ctx, cfg)
        return
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
        notes = notes_attention(pair, attention_to_cache(model, pair))  # [layer, head]: what frozen_attention ranks by
        ctx.write(key, [base | {"condition": "head_single", "layer": layer, "head": head, "recovery": float(e),
                                "attention_to_notes": float(notes[layer, head])}
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


def run_frozen(ctx: Context, cfg: HeadsHeldoutConfig) -> None:
    """Phase `frozen-<item>`: per usable item, the top k of the orders frozen on the source run
    patched beside the item's own attention ranking and random heads, k in head_ks and n_heads."""
    model = ctx.model
    frozen = read_frozen(str(cfg.frozen_from), ctx.cfg.model.name, cfg.n_heads)
    L, H = model.n_layers, int(model.adapter.n_heads(model.hf))
    if any(layer >= L or head >= H for order in frozen.orders.values() for layer, head in order):
        raise ConfigError(f"experiment.frozen_from: heads of {frozen.run_id} do not fit this model's {L} x {H}")
    for rk, why in frozen.missing.items():
        log.warning("heads_heldout: %s: %s", rk, why)
    log.info("heads_heldout: frozen on %s: %s", frozen.run_id,
             "; ".join(f"{rk} {order[:cfg.n_heads]}" for rk, order in frozen.orders.items()))
    margin, rule = resolve_margin(model, cfg.margin), margin_rule(model, cfg.margin)
    items = {str(it.item_id): it for it in ctx.items()}
    ks = sorted(set(cfg.head_ks) | {cfg.n_heads})
    rankings = [*frozen.orders, "attention"]
    for key in ctx.pending([f"frozen-{i}" for i in items], desc="frozen heads"):
        item_id = key.removeprefix("frozen-")
        pair = make_pair(model, items[item_id])
        source = {"source_run": frozen.run_id, "in_source": item_id in frozen.items}
        reason = skip_reason(pair, margin)
        if reason:
            ctx.write(key, [skipped_record(pair, margin, reason) | {"margin_rule": rule} | source])
            continue
        rng = random.Random(f"{cfg.seed}/{item_id}")
        ctx.write(key, head_records(model, pair, attention_to_cache(model, pair), ks, rankings, cfg.n_random,
                                    rng, _base(pair, margin, rule) | source, cfg.batch_size, given=frozen.orders))


# The job convention (runner/jobs.py): the runner finds this experiment by these names.
NAME = "heads_heldout"
CONFIG = HeadsHeldoutConfig
READS_TASK = True  # builds the task group's items: the runner checks task.length before loading
HELP = ("read heads ranked by their effect on the other items (cross-fitted), beside attention and in-sample; "
        "frozen_from: heads frozen on another run, tested unranked")
