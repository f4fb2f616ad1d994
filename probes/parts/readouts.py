"""Summary readouts shared by the knockout, scrub and split probes: proportions, signed reversion.

A proportion k/n carries a Wilson interval (kvnotes.measure.metrics.wilson_ci), never a zero-width one.
A signed reversion r = (oracle - score) / (oracle - stale) is summarised as a distribution, not
as "r > 0.5": its median, the share that reverts (0.5 <= r <= 1.5), the share that overshoots
past the stale score (r > 1.5) and the share that moves away from it (r < 0). Random draws of an
item are averaged per item before any of this, so n always counts items.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvnotes.measure.metrics import ci_dict, wilson_ci

REVERTED = (0.5, 1.5)  # a reversion in this band counts as "reverted"; above it: overshoot


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
