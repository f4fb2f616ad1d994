"""The summary of `+experiment=localize`, recomputed from its per-item `set` records alone.

Per item, the held-out rows (nested sets: each row names the positions its k adds) give the
recovery curve, the smallest k recovering the threshold (`k80`: the first k on the scan; exact
while every smaller k was scanned) and that set's make-up: its share per prompt segment, of
aggregator tokens and of the most-attended quarter. Means carry percentile-bootstrap CIs over
items (random draws averaged per item first), shares of items Wilson intervals, and every
per-item quantity its quantiles, since one mean hides a two-peaked distribution. Items of one
domain share its words and filler, so the headline numbers (top-k recoveries, the k80 shares, top-8
and the k80 set's aggregator and attended shares; not the per-segment shares) also carry
`ci_cluster`, the interval from resampling whole domains, and `verdict_ci`, the wider of the two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvnotes.measure.metrics import (
    ci_dict,
    cluster_bootstrap_ci,
    prop_dict,
    range_dict,
    smallest_k,
    wider,
)
from probes.parts.readouts import paired_difference

RANKINGS = ("heldout", "in_sample", "random")
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


def quantiles(values: Sequence[float]) -> dict[str, float | int]:
    """q10 .. q90 of the finite values, and their n."""
    x = np.asarray([v for v in values if np.isfinite(v)], dtype=np.float64)
    out: dict[str, float | int] = {f"q{round(q * 100)}": float(np.quantile(x, q)) if x.size else float("nan")
                                   for q in QUANTILES}
    return out | {"n": int(x.size)}


def with_cluster(out: dict[str, Any], values: Mapping[str, float], domains: Mapping[str, object],
                 n_boot: int) -> dict[str, Any]:
    """`out` (an item interval of the mean of `values`, item -> value) with the domain-cluster
    interval `ci_cluster` and `verdict_ci`, the wider of the two."""
    ids = sorted(values)
    cl = cluster_bootstrap_ci([values[i] for i in ids], [domains.get(i) for i in ids], n_boot=n_boot)
    w = wider(out, cl)
    return out | {"ci_cluster": {"cluster": "domain", **{k: v for k, v in cl.items() if k not in ("mean", "n", "interval")}},
                  "verdict_ci": [w["ci_lo"], w["ci_hi"]]}


def described(values: Mapping[str, float], n_boot: int, domains: Mapping[str, object] | None = None) -> dict[str, Any]:
    """Mean with CI and n over items, and the quantiles beside it (and the cluster interval when
    `domains` names each item's domain)."""
    v = [values[i] for i in sorted(values)]
    out = ci_dict(v, n_boot) | {"quantiles": quantiles(v)}
    return out if domains is None else with_cluster(out, values, domains, n_boot)


def share(flags: Mapping[str, bool], domains: Mapping[str, object], n_boot: int) -> dict[str, Any]:
    """Share of items (Wilson) with its domain-cluster interval."""
    return with_cluster(prop_dict([flags[i] for i in sorted(flags)]), {i: float(f) for i, f in flags.items()},
                        domains, n_boot)


def per_item_at(rows: Sequence[Mapping[str, Any]], ranking: str, k: int) -> dict[str, float]:
    """item -> recovery of its `ranking` set of size k (random draws averaged)."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        if r["ranking"] == ranking and int(r["k"]) == k:
            acc.setdefault(str(r["item_id"]), []).append(float(r["recovery"]))
    return {i: float(np.mean(v)) for i, v in acc.items()}


def contiguous(ks: Sequence[int]) -> int:
    """The largest k such that 1..k were all scanned."""
    have, k = set(ks), 0
    while k + 1 in have:
        k += 1
    return k


def smallest_set(rows: Sequence[Mapping[str, Any]], threshold: float) -> dict[str, Any]:
    """One item's held-out rows -> its k80, whether exact, and the set's positions and labels."""
    rows = sorted(rows, key=lambda r: int(r["k"]))
    ks = [int(r["k"]) for r in rows]
    k80 = smallest_k(ks, [float(r["recovery"]) for r in rows], threshold)
    out: dict[str, Any] = {"k80": k80, "exact": bool(np.isfinite(k80) and k80 <= contiguous(ks)),
                           "n_ranked": int(rows[0]["n_ranked"]), "n_unaligned": int(rows[0]["n_unaligned"])}
    if np.isfinite(k80):
        upto = [r for r in rows if int(r["k"]) <= k80]
        out["segments"] = [s for r in upto for s in r["added_segments"]]
        out["classes"] = [c for r in upto for c in r["added_classes"]]
        out["attended"] = [bool(a) for r in upto for a in r["added_attended"]]
        out["positions"] = [int(p) for r in upto for p in r["added"]]
    return out


def band_summary(rows: Sequence[Mapping[str, Any]], ks: Sequence[int], threshold: float,
                 paper_top8: Sequence[float], n_boot: int) -> dict[str, Any]:
    dom = {str(r["item_id"]): r.get("domain") for r in rows}
    out: dict[str, Any] = {"topk": {rk: {int(k): described(per_item_at(rows, rk, k), n_boot, dom) for k in ks}
                                    for rk in RANKINGS}}
    held = [r for r in rows if r["ranking"] == "heldout"]
    by_item: dict[str, list[Mapping[str, Any]]] = {}
    for r in held:
        by_item.setdefault(str(r["item_id"]), []).append(r)
    sets = {i: smallest_set(v, threshold) for i, v in sorted(by_item.items())}
    reached = {i: s for i, s in sets.items() if np.isfinite(s["k80"])}
    k80 = [s["k80"] for s in reached.values()]
    out["k80"] = {"threshold": threshold,
                  "reached": share({i: bool(np.isfinite(s["k80"])) for i, s in sets.items()}, dom, n_boot),
                  "exact": prop_dict([s["exact"] for s in reached.values()]),
                  "k": ci_dict(k80, n_boot) | {"quantiles": quantiles(k80)},
                  "le_16": share({i: bool(np.isfinite(s["k80"]) and s["k80"] <= 16) for i, s in sets.items()},
                                 dom, n_boot)}
    segs = sorted({g for s in reached.values() for g in s["segments"]})
    of_seg = {g: {i: float(np.mean([x == g for x in s["segments"]])) for i, s in reached.items()} for g in segs}
    out["k80_set"] = {
        "segments": {g: described(of_seg[g], n_boot) for g in segs},
        "aggregator_share": described({i: float(np.mean([c == "aggregator" for c in s["classes"]]))
                                       for i, s in reached.items()}, n_boot, dom),
        "attended_share": described({i: float(np.mean(s["attended"])) for i, s in reached.items()}, n_boot, dom),
    }
    n_down = {i: s["n_ranked"] + s["n_unaligned"] for i, s in sets.items()}
    out["unaligned"] = range_dict([s["n_unaligned"] for s in sets.values()]) | {
        "share": range_dict([s["n_unaligned"] / n_down[i] for i, s in sets.items() if n_down[i]])}
    h8, i8 = per_item_at(rows, "heldout", 8), per_item_at(rows, "in_sample", 8)
    gap = {i: i8[i] - h8[i] for i in sorted(set(i8) & set(h8))}
    out["top8"] = {"heldout": with_cluster(ci_dict(list(h8.values()), n_boot), h8, dom, n_boot),
                   "in_sample": with_cluster(ci_dict(list(i8.values()), n_boot), i8, dom, n_boot),
                   "in_sample_minus_heldout": with_cluster(paired_difference(i8, h8), gap, dom, n_boot),
                   "paper": list(paper_top8), "paper_measure": "top-8 by individual effect ranked in sample"}
    return out


def reading(b: Mapping[str, Any]) -> str | None:
    """The hypothesis of experiments/localize.py against one band's summary, in one line."""
    k, h8 = b["k80"], b["top8"]
    if not k["reached"]["n"] or not h8["heldout"]["n"]:
        return None
    med = k["k"]["quantiles"]["q50"]
    agg, att = b["k80_set"]["aggregator_share"], b["k80_set"]["attended_share"]
    gap = b["top8"]["in_sample_minus_heldout"]
    parts = [f"{k['reached']['k']}/{k['reached']['n']} items reach {k['threshold']:g} with a held-out set"
             + (f" (median k {med:g} over those)" if np.isfinite(med) else "")
             + f", {k['le_16']['k']}/{k['le_16']['n']} with at most 16 positions",
             f"top-8 held-out {h8['heldout']['mean']:.2f} vs in-sample {h8['in_sample']['mean']:.2f} "
             f"(paper, in sample, {h8['paper'][0]:.2f}-{h8['paper'][1]:.2f})"]
    if agg["n"]:
        parts.append(f"the set is {agg['mean']:.0%} aggregator tokens and {att['mean']:.0%} in the most-attended quarter")
    holds = (k["le_16"]["mean"] > 0.5
             and abs(gap["mean"]) <= 0.15 and agg["n"] and agg["mean"] < 0.5 and att["mean"] > 0.5)
    return "; ".join(parts) + (": the hypothesis holds." if holds else ": the hypothesis does not hold as written.")


def summarize_sets(records: Sequence[Mapping[str, Any]], ks: Sequence[int], threshold: float,
                   paper_top8: Sequence[float], n_boot: int = 2000) -> dict[str, Any]:
    """Band `all` at the top level; the layer thirds under `by_band` when the run has them."""
    rows = [r for r in records if r.get("condition") == "set"]
    names = sorted({str(r["band"]) for r in rows})
    out: dict[str, Any] = {"n_ranked_items": len({r["item_id"] for r in rows}), "ks": [int(k) for k in ks]}
    if "all" in names:
        out |= band_summary([r for r in rows if r["band"] == "all"], ks, threshold, paper_top8, n_boot)
        text = reading(out)
        if text:
            out["reading"] = text
    if any(n != "all" for n in names):
        out["by_band"] = {n: band_summary([r for r in rows if r["band"] == n], ks, threshold, paper_top8, n_boot)
                          for n in names if n != "all"}
    return out
