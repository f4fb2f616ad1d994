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

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from kvnotes.edit.attribution import METHODS, attribute_cache, encode, to_recovery, top_positions
from kvnotes.edit.patching import PatchPair, patched_scores, recoveries
from kvnotes.measure.metrics import ci_dict, cluster_bootstrap_ci
from kvnotes.measure.timing import measure
from kvnotes.models.loading import LoadedModel
from kvnotes.tasks.item import TaskItem
from probes.parts.common import pair_fields, run_pairs, skip_summary, token_texts


@dataclass
class AttributionConfig:
    margin: float | None = None  # None: the model config's margin
    exact: bool = True  # the exact per-position map over the field and after (Spearman needs it)
    exact_layers: bool = True  # the exact position x layer map too (one variant per position and layer)
    # None: every position x layer cell is read exactly; n: a uniform random sample of n cells per
    # item (seeded by the item id), whose Spearman estimates the full one at a fraction of the cost
    layer_cells: int | None = None
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
        if self.layer_cells is not None and self.layer_cells < 3:
            raise ValueError(f"layer_cells must be >= 3 (a Spearman needs three cells) or null, got {self.layer_cells}")
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


LAYER_CHECK = 1024  # with every cell read, the Spearman over a sample this size is recorded too


def _cell_sample(item_id: str, n_cells: int, k: int) -> np.ndarray:
    """Indices of a uniform random sample of k of n_cells cells (all when k >= n_cells), sorted;
    seeded by the item id, so a rerun and a full run of the same item draw the same cells."""
    if k >= n_cells:
        return np.arange(n_cells)
    rng = np.random.default_rng(zlib.crc32(item_id.encode()))
    return np.sort(rng.choice(n_cells, size=k, replace=False))


def _layer_agreement(model: LoadedModel, pair: PatchPair, qk: np.ndarray, lin: np.ndarray,
                     cfg: AttributionConfig) -> dict[str, Any]:
    """Spearman over position x layer cells (exact: one variant per cell read) and the layer where
    the estimate misses most (largest mean |attribution - exact| recovery over its cells read).

    With `layer_cells` set, only a uniform random sample of the cells is read; the Spearman over
    it estimates the full one (`n_layer_cells` says how many cells were read). With every cell
    read, the Spearman over the LAYER_CHECK-cell sample of the same draw is recorded as well
    (`spearman_position_layer_sampled`), which measures that estimator's error on real items."""
    cand, n_layers = pair.field_to_end, model.n_layers
    n_cells = len(cand) * n_layers
    read = _cell_sample(pair.item.item_id, n_cells, cfg.layer_cells) if cfg.layer_cells else np.arange(n_cells)
    pos, lay = np.asarray(cand)[read // n_layers], read % n_layers
    s = patched_scores(model, pair, [[int(p)] for p in pos], [[int(la)] for la in lay], batch_size=cfg.batch_size)
    exact = np.full(n_cells, np.nan)
    exact[read] = recoveries(pair, s)
    est_qk, est_lin = (to_recovery(pair, m[cand]).ravel() for m in (qk, lin))  # [pos * layer]
    miss = np.abs(est_qk - exact).reshape(len(cand), n_layers)
    per_layer = np.array([np.nanmean(c) if np.isfinite(c).any() else -np.inf for c in miss.T])  # [layer]
    out = {"spearman_position_layer": _spearman(est_qk[read], exact[read]),
           "spearman_position_layer_linear": _spearman(est_lin[read], exact[read]),
           "n_layer_cells": len(read), "n_layer_cells_all": n_cells,
           "worst_layer": int(np.argmax(per_layer)), "worst_rel_layer": float(np.argmax(per_layer) / max(1, n_layers - 1))}
    if len(read) == n_cells and n_cells > LAYER_CHECK:
        sub = _cell_sample(pair.item.item_id, n_cells, LAYER_CHECK)
        out["spearman_position_layer_sampled"] = _spearman(est_qk[sub], exact[sub])
    return out


def run(model: LoadedModel, items: Sequence[TaskItem], cfg: AttributionConfig) -> list[dict[str, Any]]:
    return run_pairs(model, items, cfg.margin, lambda pair, m: item_records(model, pair, cfg, m))


STATS = ("spearman_position", "spearman_position_linear", "spearman_position_layer",
         "spearman_position_layer_linear", "spearman_position_layer_sampled", "n_layer_cells", "n_layer_cells_all",
         "sign_agree", "qk_change", "attribution_s", "exact_s")
CLUSTERED = ("spearman_position", "spearman_position_layer", "sign_agree")  # + overlaps and recoveries


def summarize(records: Sequence[Mapping[str, Any]], cfg: AttributionConfig) -> dict[str, Any]:
    out = skip_summary(records)
    rows = [r for r in records if r.get("condition") == "item"]
    names = [*STATS, *(f"overlap_{k}{t}" for k in cfg.top_k for t in ("", "_linear")),
             *(f"recovery_top{cfg.top_k[0]}_{w}" for w in ("attribution", "attribution_linear", "exact"))]
    stats = {n: ci_dict([float(r.get(n, np.nan)) for r in rows], n_boot=cfg.n_boot) for n in names
             if any(n in r for r in rows)}
    out["stats"] = stats
    # items share a domain (its templates and rules): the domain-cluster bootstrap beside the item one
    domains = [str(r.get("domain", "")) for r in rows]
    out["stats_cluster"] = {
        n: cluster_bootstrap_ci([float(r.get(n, np.nan)) for r in rows], domains, n_boot=cfg.n_boot)
        for n in (*CLUSTERED, *(f"overlap_{k}" for k in cfg.top_k),
                  *(f"recovery_top{cfg.top_k[0]}_{w}" for w in ("attribution", "exact")))
        if n in stats}
    pairs = [(float(r["spearman_position_layer"]), float(r["spearman_position_layer_sampled"]))
             for r in rows if "spearman_position_layer_sampled" in r]
    if pairs:  # how far the LAYER_CHECK-cell estimate falls from the full position x layer Spearman
        err = np.array([b - a for a, b in pairs])
        out["layer_sample_error"] = {"cells": LAYER_CHECK, "mean": float(np.nanmean(err)),
                                     "max_abs": float(np.nanmax(np.abs(err))), "n": int(np.isfinite(err).sum())}
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
