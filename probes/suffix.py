"""Probe `suffix`: are the notes concentrated at the end of the downstream span?

Cumulative recovery when the new run's K/V is patched into the old cache over the *last* k % vs
the *first* k % of the downstream span (positions after the field); over the top-k positions by
individual effect (k = 1, 2, 4, ..., 128) against random sets of the same size; and over layer
bands (early / mid / late thirds) of the whole downstream span. The paper: the suffix curve
reaches ~0.8 by 20 % while the prefix curve stays ~0.3 until 70 %; top-8 0.74-0.79 vs random-8
<= 0.035. Where the curves differ from the paper's, the prompt layout says why: each position's
individual effect is attributed to its prompt segment (session, policy, tools, rule, examples,
request, task line, ...; TaskItem.segments), with the segment's place in the downstream span (%)
and its share of the top-k positions, and the share of the top-k that lies within the first k %.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvnotes.edit.patching import PatchPair, patched_scores, recoveries
from kvnotes.measure.metrics import ci_dict
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from probes.parts.common import bands, curve, item_fields, run_pairs, segment_of, skip_summary

K_PERCENT = [2, 5, 10, 20, 30, 50, 70, 90, 100]
TOP_K = [1, 2, 4, 8, 16, 32, 64, 128]


@dataclass
class SuffixConfig:
    margin: float | None = None  # None: the model config's margin
    percents: list[int] = field(default_factory=lambda: list(K_PERCENT))
    top_k: list[int] = field(default_factory=lambda: list(TOP_K))
    n_random: int = 5  # random draws per k for the random-k baseline
    random_seed: int = 0
    batch_size: int = 128
    unit_size: int = 1
    n_boot: int = 1000
    segment_top_k: int = 8  # the top positions whose segments are counted (paper: top-8)

    def __post_init__(self) -> None:
        if any(not 0 < k <= 100 for k in self.percents):
            raise ValueError(f"percents must be in (0, 100], got {self.percents}")
        if any(k < 1 for k in self.top_k) or self.n_random < 0:
            raise ValueError("top_k must be >= 1 and n_random >= 0")
        if self.segment_top_k < 1:
            raise ValueError("segment_top_k must be >= 1")


def item_records(
    model: LoadedModel, pair: PatchPair, cfg: SuffixConfig, margin: float
) -> list[dict[str, Any]]:
    item, down = pair.item, pair.downstream_positions
    base = item_fields(item) | {"margin": margin, "score_stale": pair.score_stale,
                                "score_oracle": pair.score_oracle, "n_downstream": len(down)}
    rows: list[dict[str, Any]] = []
    states: list[list[int]] = []
    layers: list[list[int] | None] = []

    def add(row: dict[str, Any], positions: list[int], lay: list[int] | None = None) -> None:
        rows.append(base | row)
        states.append(positions)
        layers.append(lay)

    for k in cfg.percents:
        n = max(1, math.ceil(len(down) * k / 100))
        add({"condition": "suffix", "k": k, "n_positions": n}, down[-n:])
        add({"condition": "prefix", "k": k, "n_positions": n}, down[:n])
    for name, lay in bands(model.n_layers).items():
        add({"condition": "band", "band": name}, down, lay)
    # individual effects of every downstream position rank the top-k sets
    single = patched_scores(model, pair, [[p] for p in down], batch_size=cfg.batch_size)
    effect = recoveries(pair, single)
    order = [down[i] for i in np.argsort(-np.nan_to_num(effect, nan=-np.inf), kind="stable")]
    extra = segment_records(item, down, effect, order[: cfg.segment_top_k], cfg.percents)
    rng = random.Random(cfg.random_seed)
    for k in [k for k in cfg.top_k if k <= len(down)]:
        add({"condition": "topk", "k": k, "n_positions": k}, sorted(order[:k]))
        for draw in range(cfg.n_random):
            add({"condition": "randomk", "k": k, "n_positions": k, "draw": draw},
                sorted(rng.sample(down, k)))
    scores = patched_scores(model, pair, states, layers, batch_size=cfg.batch_size)
    for row, s, r in zip(rows, scores, recoveries(pair, scores), strict=True):
        row["score"], row["recovery"] = float(s), float(r)
    return rows + [base | r for r in extra]


def segment_records(item: TaskItem, down: list[int], effect: np.ndarray, top: list[int],
                    percents: list[int]) -> list[dict[str, Any]]:
    """Where the individually effective positions sit: one record per prompt segment (its place in
    the downstream span in %, summed single-position recovery, how many of the top positions it
    holds) and one saying which share of the top positions lies within the first k %."""
    if not np.isfinite(effect).any():  # recovery undefined (|oracle - stale| ~ 0): no ranking
        return []
    span = len(down)
    index = {p: i for i, p in enumerate(down)}
    segs: dict[str, list[int]] = {}
    for p in down:
        segs.setdefault(segment_of(item, p), []).append(index[p])
    top_idx = [index[p] for p in top]
    rows: list[dict[str, Any]] = []
    for name, idx in segs.items():
        eff = effect[idx]
        some = bool(np.isfinite(eff).any())
        rows.append({"condition": "segment", "segment": name, "start_pct": 100 * min(idx) / span,
                     "end_pct": 100 * (max(idx) + 1) / span, "n_positions": len(idx),
                     "effect_sum": float(np.nansum(eff)) if some else float("nan"),
                     "effect_max": float(np.nanmax(eff)) if some else float("nan"),
                     "n_top": sum(i in set(idx) for i in top_idx), "top_k": len(top_idx)})
    rows.append({"condition": "top_positions", "top_k": len(top_idx),
                 "positions": str(sorted(top)), "top_pct": str([round(100 * i / span, 1) for i in sorted(top_idx)]),
                 "top_segments": str([segment_of(item, p) for p in sorted(top)]),
                 **{f"top_within_first_{k}": sum(i < math.ceil(span * k / 100) for i in top_idx) / max(1, len(top_idx))
                    for k in percents}})
    return rows


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: SuffixConfig) -> list[dict[str, Any]]:
    return run_pairs(model, items, cfg.margin, lambda pair, m: item_records(model, pair, cfg, m))


def summarize(records: Sequence[Mapping[str, Any]], cfg: SuffixConfig) -> dict[str, Any]:
    out = skip_summary(records)
    out["suffix"] = curve(records, "suffix", "k")
    out["prefix"] = curve(records, "prefix", "k")
    out["topk"] = curve(records, "topk", "k")
    # random-k: average the draws of an item first, so n counts items, not draws
    per_item: dict[tuple[str, int], list[float]] = {}
    for r in records:
        if r.get("condition") == "randomk":
            per_item.setdefault((r["item_id"], r["k"]), []).append(r["recovery"])
    means = [{"item_id": i, "k": k, "condition": "randomk_mean",
              "recovery": float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")}  # all-NaN: NaN, no warning
             for (i, k), v in per_item.items()]
    out["randomk"] = curve(means, "randomk_mean", "k")
    out["bands"] = curve(records, "band", "band")
    if any(r.get("condition") == "segment" for r in records):
        out |= summarize_segments(records, cfg)
    return out


def summarize_segments(records: Sequence[Mapping[str, Any]], cfg: SuffixConfig) -> dict[str, Any]:
    """Per segment (in prompt order): its mean place in the downstream span, the share of the top-k
    positions it holds and its summed single-position recovery (CIs over items); and the share of
    the top-k within the first k %, which is what a prefix curve can reach."""
    seg = [r for r in records if r.get("condition") == "segment"]
    names = sorted({str(r["segment"]) for r in seg},
                   key=lambda n: np.mean([r["start_pct"] for r in seg if r["segment"] == n]))
    items = list(dict.fromkeys(r["item_id"] for r in seg))  # record order: a set's order changes with the hash seed
    out: list[dict[str, Any]] = []
    for n in names:
        rows = {r["item_id"]: r for r in seg if r["segment"] == n}
        share = [rows[i]["n_top"] / rows[i]["top_k"] if i in rows else 0.0 for i in items]
        out.append({"segment": n, "start_pct": float(np.mean([r["start_pct"] for r in rows.values()])),
                    "end_pct": float(np.mean([r["end_pct"] for r in rows.values()])),
                    "n_positions": float(np.mean([r["n_positions"] for r in rows.values()])),
                    "top_share": ci_dict(share, cfg.n_boot),
                    "effect_sum": ci_dict([r["effect_sum"] for r in rows.values()], cfg.n_boot)})
    tops = [r for r in records if r.get("condition") == "top_positions"]
    within = {k: ci_dict([r[f"top_within_first_{k}"] for r in tops], cfg.n_boot)
              for k in cfg.percents if tops and f"top_within_first_{k}" in tops[0]}
    explained = explain_prefix(out, within, 70)
    return {"segments": out, "segment_top_k": cfg.segment_top_k, "top_within_first_pct": within,
            "prefix_explained": explained, **({"reading": explained} if explained else {})}


def explain_prefix(segments: Sequence[Mapping[str, Any]], within: Mapping[int, Any], k: int) -> str | None:
    """One sentence: which segments the first k % of the downstream span covers, and which share
    of the top positions lies there (None when k % was not measured)."""
    if k not in within or not segments:
        return None
    inside = [s["segment"] for s in segments if s["end_pct"] <= k]
    beyond = [s for s in segments if s["end_pct"] > k]
    heavy = max(segments, key=lambda s: s["top_share"]["mean"])
    w = within[k]
    return (f"the first {k} % of the downstream span covers {', '.join(inside) or 'no whole segment'}; "
            f"it holds {w['mean']:.2f} [{w['ci_lo']:.2f}, {w['ci_hi']:.2f}] of the top positions (n={w['n']}); "
            f"the most top positions sit in {heavy['segment']} ({heavy['start_pct']:.0f}-{heavy['end_pct']:.0f} %, "
            f"share {heavy['top_share']['mean']:.2f}); beyond {k} %: {', '.join(s['segment'] for s in beyond)}")


# The job convention (runner/jobs.py): the runner finds this probe by these names.
NAME = "suffix"
CONFIG = SuffixConfig
HELP = "suffix concentration: last vs first k% of the downstream span, top-k vs random-k, layer bands"
