"""Probe `attribution`: the notes map from one backward pass, checked against exact patching.

Per usable item, kvnotes.edit.attribution estimates the effect of patching every cached K and V
entry (position x layer x KV head) from the new run into the old from one forward and one
backward over the stale cache (keys linear, and with AtP*'s QK fix); the map is stored compactly
(float16). Exact patching checks it: the per-position map (one position, all layers; recovery),
optionally the position x layer map, and the joint patch of the top-k positions chosen by
attribution against the top-k chosen by exact effect. Positions are ranked by signed recovery
(towards the new value first) among the field and everything after it; before the field the K/V
of both runs are identical and both maps are exactly 0. Summary: `spearman_position`, the mean
per-item Spearman correlation with the exact map over positions, beside its linear-key twin,
top-k overlaps, top-k recoveries and the cost of each map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from kvnotes.edit.attribution import METHODS, attribute_cache, encode, to_recovery, top_positions
from kvnotes.edit.patching import PatchPair, patched_scores, recoveries
from kvnotes.measure.metrics import ci_dict
from kvnotes.measure.timing import measure
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from probes.parts.common import pair_fields, run_pairs, skip_summary, token_texts


@dataclass
class AttributionConfig:
    margin: float | None = None  # None: the model config's margin
    exact: bool = True  # the exact per-position map over the field and after (Spearman needs it)
    exact_layers: bool = True  # the exact position x layer map too (one variant per position and layer)
    top_k: list[int] = field(default_factory=lambda: [8, 32])  # overlaps; the first k is also patched jointly
    batch_size: int | None = None  # patched variants per forward; None: sized from the free memory
    unit_size: int = 1  # items per resumable unit
    n_boot: int = 2000

    def __post_init__(self) -> None:
        if self.margin is not None and self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if not self.top_k or any(k < 1 for k in self.top_k):
            raise ValueError(f"top_k must be a non-empty list of ints >= 1, got {self.top_k}")
        if self.exact_layers and not self.exact:
            raise ValueError("exact_layers=true needs exact=true")
        if (self.batch_size is not None and self.batch_size < 1) or self.unit_size < 0:
            raise ValueError("batch_size must be >= 1 and unit_size >= 0")


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho over the finite pairs; NaN when either side is constant or too short."""
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.ptp(a[ok]) == 0 or np.ptp(b[ok]) == 0:
        return float("nan")
    return float(spearmanr(a[ok], b[ok]).statistic)



def item_records(
    model: LoadedModel, pair: PatchPair, cfg: AttributionConfig, margin: float
) -> list[dict[str, Any]]:
    """The stored map, per-position rows and one row of per-item agreement with exact patching."""
    item = pair.item
    base = pair_fields(pair, margin)
    amap, attr_s, _ = measure(lambda: attribute_cache(model, pair), model.device, memory=False)
    cand = pair.field_to_end
    est = {m: to_recovery(pair, amap.per_position(m)) for m in METHODS}  # [n_cached] each
    exact = np.full(pair.n_cached, np.nan)
    k_max = max(cfg.top_k)
    read = cand if cfg.exact else sorted({p for m in METHODS for p in top_positions(est[m], k_max, cand)})
    scores, exact_s, _ = measure(lambda: patched_scores(model, pair, [[p] for p in read], batch_size=cfg.batch_size),
                                 model.device, memory=False)
    exact[read] = recoveries(pair, scores)
    stats: dict[str, Any] = {"attribution_s": attr_s, "exact_s": exact_s if cfg.exact else float("nan"),
                             "n_candidates": len(cand)}
    key_abs = np.abs(amap.key_linear).sum()
    stats["qk_change"] = float(np.abs(amap.key_qk - amap.key_linear).sum() / key_abs) if key_abs else float("nan")
    k0 = cfg.top_k[0]
    tops = {m: top_positions(est[m], k0, cand) for m in METHODS}
    joint = [tops["qk"], tops["linear"]]
    if cfg.exact:
        exact_top = top_positions(exact, k0, cand)
        joint.append(exact_top)
        for m in METHODS:
            tag = "" if m == "qk" else "_linear"
            stats[f"spearman_position{tag}"] = _spearman(est[m][cand], exact[cand])
            for k in cfg.top_k:
                kk = min(k, len(cand))
                both = set(top_positions(est[m], kk, cand)) & set(top_positions(exact, kk, cand))
                stats[f"overlap_{k}{tag}"] = len(both) / kk
        big = np.abs(exact[cand]) >= 0.01  # positions that move the decision at least 1 % of the way
        agree = np.sign(est["qk"][cand]) == np.sign(exact[cand])
        stats["sign_agree"] = float(agree[big].mean()) if big.any() else float("nan")
    rec_joint = recoveries(pair, patched_scores(model, pair, joint, batch_size=cfg.batch_size))
    stats[f"recovery_top{k0}_attribution"] = float(rec_joint[0])
    stats[f"recovery_top{k0}_attribution_linear"] = float(rec_joint[1])
    if cfg.exact:
        stats[f"recovery_top{k0}_exact"] = float(rec_joint[2])
    if cfg.exact_layers:
        stats |= _layer_agreement(model, pair, amap.per_position_layer("qk"), amap.per_position_layer("linear"), cfg)
    tokens = token_texts(model, item.old_ids)
    aggregators = set(item.aggregators)
    out = [base | {"condition": "item", **stats},
           base | {"condition": "map", **encode(amap)},
           base | {"condition": "tokens", "tokens": tokens,
                   "new_tokens": token_texts(model, item.new_ids[slice(*item.field_span)])}]
    out += [base | {"condition": "position", "position": p, "token": tokens[p], "in_field": p < item.field_span[1],
                    "is_aggregator": p in aggregators, "recovery": float(exact[p]),
                    "attribution": float(est["qk"][p]), "attribution_linear": float(est["linear"][p])}
            for p in cand]
    return out


def _layer_agreement(model: LoadedModel, pair: PatchPair, qk: np.ndarray, lin: np.ndarray,
                     cfg: AttributionConfig) -> dict[str, Any]:
    """Spearman over position x layer cells (exact: one variant per cell) and the layer where the
    estimate misses most (largest summed |attribution - exact| recovery over positions)."""
    cand, layers = pair.field_to_end, list(range(model.n_layers))
    cells = [(p, la) for p in cand for la in layers]
    s = patched_scores(model, pair, [[p] for p, _ in cells], [[la] for _, la in cells], batch_size=cfg.batch_size)
    exact = recoveries(pair, s).reshape(len(cand), len(layers))  # [pos, layer]
    est_qk, est_lin = (to_recovery(pair, m[cand]) for m in (qk, lin))  # [pos, layer]
    miss = np.nansum(np.abs(est_qk - exact), axis=0)  # [layer]
    return {"spearman_position_layer": _spearman(est_qk.ravel(), exact.ravel()),
            "spearman_position_layer_linear": _spearman(est_lin.ravel(), exact.ravel()),
            "worst_layer": int(np.argmax(miss)), "worst_rel_layer": float(np.argmax(miss) / max(1, len(layers) - 1))}


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: AttributionConfig) -> list[dict[str, Any]]:
    return run_pairs(model, items, cfg.margin, lambda pair, m: item_records(model, pair, cfg, m))


STATS = ("spearman_position", "spearman_position_linear", "spearman_position_layer",
         "spearman_position_layer_linear", "sign_agree", "qk_change", "attribution_s", "exact_s")


def summarize(records: Sequence[Mapping[str, Any]], cfg: AttributionConfig) -> dict[str, Any]:
    out = skip_summary(records)
    rows = [r for r in records if r.get("condition") == "item"]
    names = [*STATS, *(f"overlap_{k}{t}" for k in cfg.top_k for t in ("", "_linear")),
             *(f"recovery_top{cfg.top_k[0]}_{w}" for w in ("attribution", "attribution_linear", "exact"))]
    stats = {n: ci_dict([float(r.get(n, np.nan)) for r in rows], n_boot=cfg.n_boot) for n in names
             if any(n in r for r in rows)}
    out["stats"] = stats
    out["spearman_position"] = stats.get("spearman_position", {}).get("mean", float("nan"))
    a, e = (stats.get(f"recovery_top{cfg.top_k[0]}_{w}", {}).get("mean") for w in ("attribution", "exact"))
    if a is not None and e:
        out[f"recovery_top{cfg.top_k[0]}_ratio"] = a / e  # attribution's top-k against exact's
    t_a, t_e = (stats.get(n, {}).get("mean") for n in ("attribution_s", "exact_s"))
    if t_a and t_e:
        out["cost_exact_over_attribution"] = t_e / t_a
    worst = [int(r["worst_layer"]) for r in rows if "worst_layer" in r]
    if worst:
        out["worst_layer_counts"] = {str(la): worst.count(la) for la in sorted(set(worst))}
    return out


# The job convention (runner/jobs.py): the runner finds this probe by these names.
NAME = "attribution"
CONFIG = AttributionConfig
HELP = "attribution patching of the cache (AtP, AtP* QK fix) checked against exact patching"
