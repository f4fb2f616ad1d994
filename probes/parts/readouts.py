"""Summary readouts shared by the knockout, scrub and split probes: proportions, signed reversion.

A proportion k/n carries a Wilson interval (kvnotes.measure.metrics.wilson_ci), never a zero-width one.
A signed reversion r = (oracle - score) / (oracle - stale) is summarised as a distribution, not
as "r > 0.5": its median, the share that reverts (0.5 <= r <= 1.5), the share that overshoots
past the stale score (r > 1.5) and the share that moves away from it (r < 0). Random draws of an
item are averaged per item before any of this, so n always counts items.

As decisions (`decision_shares`): whether the decision went back to the old answer
(kvnotes.measure.metrics.flipped_back on the item's draw-averaged score, raw, and calibrated when
the records carry the content-free score `score_cf`), the share reaching r >= 0.5 (overshoot
included) and the share moving away (r < 0), each with its Wilson interval and a cluster bootstrap
over domains (`ci_cluster`); `verdict_ci` is the wider of the two. The distribution of r is kept
as quantiles and a histogram, since it is two-peaked and no window or mean describes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvnotes.measure.metrics import ci_dict, cluster_bootstrap_ci, flipped_back, wider, wilson_ci

REVERTED = (0.5, 1.5)  # a reversion in this band counts as "reverted"; above it: overshoot
QUANTILES = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)
HIST_EDGES = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0)  # bins below -1 and above 2 are open


def proportion(flags: Iterable[bool | float]) -> dict[str, float | int]:
    """Share of true flags (NaN entries dropped) with its 95 % Wilson interval."""
    x = [bool(f) for f in flags if not (isinstance(f, float) and math.isnan(f))]
    p, lo, hi = wilson_ci(sum(x), len(x))
    return {"mean": p, "ci_lo": lo, "ci_hi": hi, "k": sum(x), "n": len(x)}


def reverted(r: float) -> bool:
    return bool(REVERTED[0] <= r <= REVERTED[1])


def reversion_stats(values: Iterable[float]) -> dict[str, Any]:
    """The signed reversion distribution over items (finite values only)."""
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=np.float64)
    return {
        "median": float(np.median(v)) if v.size else float("nan"),
        "mean_reversion": ci_dict(v),
        "share_reverted": proportion(reverted(x) for x in v),  # 0.5 <= r <= 1.5
        "share_overshoot": proportion(x > REVERTED[1] for x in v),
        "share_away": proportion(x < 0 for x in v),
        "n": int(v.size),
    }


def per_item(
    records: Sequence[Mapping[str, Any]], keep: Callable[[Mapping[str, Any]], bool], key: str
) -> dict[str, float]:
    """item_id -> mean of `key` over the kept records of that item (draws averaged per item)."""
    acc: dict[str, list[float]] = {}
    for r in records:
        if keep(r):
            acc.setdefault(str(r["item_id"]), []).append(float(r[key]))
    return {i: float(np.nanmean(v)) if np.isfinite(v).any() else float("nan") for i, v in acc.items()}


def paired_difference(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float | int]:
    """Mean over items present in both of a[item] - b[item], with the bootstrap CI."""
    return ci_dict(a[i] - b[i] for i in sorted(set(a) & set(b)))


def clustered_share(flags: Mapping[str, float], clusters: Mapping[str, object]) -> dict[str, Any]:
    """Share of items (item -> 0/1, NaN dropped) with its Wilson interval, the cluster bootstrap
    over `clusters` (item -> domain) as `ci_cluster`, and `verdict_ci`, the wider of the two."""
    ids = [i for i in sorted(flags) if math.isfinite(flags[i])]
    out: dict[str, Any] = proportion(bool(flags[i]) for i in ids)
    cl = cluster_bootstrap_ci([flags[i] for i in ids], [clusters.get(i) for i in ids])
    out["ci_cluster"] = {"cluster": "domain", **{k: v for k, v in cl.items() if k not in ("mean", "n", "interval")}}
    w = wider(out, cl)
    out["verdict_ci"] = [w["ci_lo"], w["ci_hi"]]
    return out


def decision_shares(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The decision readout of one key set (rows of many items; draws of an item averaged first)."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        by.setdefault(str(r["item_id"]), []).append(r)
    ids = sorted(by)
    first = [by[i][0] for i in ids]
    def mean(i: str, key: str) -> float:
        v = [float(r[key]) for r in by[i] if math.isfinite(float(r[key]))]
        return float(np.mean(v)) if v else math.nan
    score = np.array([mean(i, "score") for i in ids], dtype=np.float64)
    rev = np.array([mean(i, "reversion") for i in ids], dtype=np.float64)
    stale, oracle = (np.array([float(r[k]) for r in first]) for k in ("score_stale", "score_oracle"))
    domains = {i: r.get("domain") for i, r in zip(ids, first, strict=True)}

    def share(x: np.ndarray) -> dict[str, Any]:
        return clustered_share(dict(zip(ids, x.tolist(), strict=True)), domains)
    cf = np.array([float(r.get("score_cf", math.nan)) for r in first], dtype=np.float64)
    ok = np.isfinite(rev)
    out: dict[str, Any] = {
        "flip": share(flipped_back(score, stale, oracle)) | {"readout": "raw"},
        "flip_calibrated": (share(flipped_back(score, stale, oracle, cf)) | {"readout": "calibrated"}
                            if cf.size and np.isfinite(cf).all() else
                            {"n": 0, "why": "the records carry no content-free score (score_cf)"}),
        "reached_half": share(np.where(ok, rev >= REVERTED[0], np.nan)),  # r >= 0.5, overshoot included
        "away": share(np.where(ok, rev < 0, np.nan)),
        "quantiles": {f"{q:g}": float(np.quantile(rev[ok], q)) if ok.any() else math.nan for q in QUANTILES},
        "histogram": {"edges": list(HIST_EDGES),
                      "counts": np.bincount(np.searchsorted(HIST_EDGES, rev[ok], side="right"),
                                            minlength=len(HIST_EDGES) + 1).tolist()},
    }
    return out
