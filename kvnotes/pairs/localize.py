"""Where the notes are, ranked on held-out pairs; and a linear probe of the residual stream.

Localization: each usable pair's exact per-position map (one position after the field, all
layers, clean K/V into the corrupt run); positions keyed (span, offset) so that pairs of one
template line up (+i from a span's start in its first half, -j from its end in its second; a
pair with no named spans has one span, everything after the field); then per pair its positions
ranked by the mean effect at their key over the *other* pairs (its own map never enters its
ranking) and patched as nested top-k sets; `k_threshold` is the smallest k recovering the
threshold. Linear probe: logistic regression on the residual stream at one position, per layer,
cross-validated over groups (prompts of one group never in both train and test folds).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from kvnotes.edit.patching import patched_scores
from kvnotes.engine.interp import residual_stream
from kvnotes.measure.metrics import wilson_ci
from kvnotes.models.loading import LoadedModel
from kvnotes.pairs.instruments import _recovery, gate, prepare
from kvnotes.pairs.pair import Prompt, _render

Key = tuple[str, int]
K = TypeVar("K", bound=Hashable)
ALIGN = ("both", "start", "end")


def downstream_spans(item: Any, n_cached: int) -> dict[str, tuple[int, int]]:
    """Each segment cut to the downstream span [field_end, n_cached): the field's own segment
    starts after the field, the last segment loses the uncached decision token."""
    lo = item.field_span[1]
    out = {}
    for name, (a, b) in item.segments.items():
        a, b = max(a, lo), min(b, n_cached)
        if a < b:
            out[name] = (a, b)
    return out


def position_keys(item: Any, n_cached: int, align: str = "both") -> dict[int, Key]:
    """Downstream position -> (segment, offset): +i from the segment's start, -j from its end
    (last token -1); `both`: +i in the first half, -j in the second. Positions in no segment are
    absent (they cannot be aligned); an item without segments has one, `notes`, after the field."""
    if align not in ALIGN:
        raise ValueError(f"align must be one of {', '.join(ALIGN)}, got {align!r}")
    spans = downstream_spans(item, n_cached) if item.segments else {"notes": (item.field_span[1], n_cached)}
    out: dict[int, Key] = {}
    for name, (a, b) in spans.items():
        for p in range(a, b):
            i, j = p - a, b - p
            front = align == "start" or (align == "both" and i < j)
            out[p] = (name, i if front else -j)
    return out


def heldout_order(keys: Mapping[int, K], others: Sequence[Mapping[K, float]]) -> tuple[list[int], list[int]]:
    """(ranked, unaligned): the item's positions by the mean effect at their key over the *other*
    items' maps (highest first, ties by position); positions whose key no other item has are
    unaligned. The item's own map is not an argument: it cannot enter its ranking."""
    scored, unaligned = [], []
    for p, k in sorted(keys.items()):
        vals = [m[k] for m in others if k in m and np.isfinite(m[k])]
        if vals:
            scored.append((-float(np.mean(vals)), p))
        else:
            unaligned.append(p)
    return [p for _, p in sorted(scored)], unaligned


def scan_ks(k_scan: int, n: int) -> list[int]:
    """1..k_scan one by one, then doubling, then all n (each <= n)."""
    ks = list(range(1, min(k_scan, n) + 1))
    k = k_scan * 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + ([n] if n > (ks[-1] if ks else 0) else [])


def localize(model: LoadedModel, pairs: Sequence[Any], threshold: float = 0.8, k_scan: int = 32,
             align: str = "both", by_cluster: bool = False, margin: float | None = None,
             batch_size: int | None = None) -> pd.DataFrame:
    """Held-out localization over `pairs` (Pairs or TaskItems; at least two usable): one row per
    pair and k with the recovery of its top-k held-out positions. `by_cluster`: rank on the other
    pairs of the same cluster only. attrs `k_threshold` (pair -> smallest k reaching `threshold`,
    NaN when none does) and `n_usable`."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    prepared = [prepare(model, p) for p in pairs]
    usable = [pp for pp in prepared if gate(model, pp, margin)[1] is None]
    if len(usable) < 2:
        raise ValueError(f"{len(usable)} of {len(pairs)} pairs are usable; a held-out ranking needs at least two")
    keys = {pp.item.item_id: position_keys(pp.item, pp.n_cached, align) for pp in usable}
    maps: dict[str, dict[Key, float]] = {}
    for pp in usable:
        pos = sorted(keys[pp.item.item_id])
        rec = _recovery(pp, patched_scores(model, pp, [[p] for p in pos], batch_size=batch_size), None)
        maps[pp.item.item_id] = {keys[pp.item.item_id][p]: float(r) for p, r in zip(pos, rec, strict=True)}
    rows: list[dict[str, Any]] = []
    k_at: dict[str, float] = {}
    for pp in usable:
        me = pp.item.item_id
        others = [maps[o.item.item_id] for o in usable if o.item.item_id != me
                  and (not by_cluster or o.item.domain == pp.item.domain)]
        ranked, unaligned = heldout_order(keys[me], others)
        ks = scan_ks(k_scan, len(ranked))
        rec = _recovery(pp, patched_scores(model, pp, [ranked[:k] for k in ks], batch_size=batch_size), None)
        hit = [k for k, r in zip(ks, rec, strict=True) if r >= threshold]
        k_at[me] = float(hit[0]) if hit else float("nan")
        rows += [{"pair_id": me, "cluster": pp.item.domain, "k": k, "recovery": float(r), "n_ranked": len(ranked),
                  "n_unaligned": len(unaligned), "positions": ranked[:k]} for k, r in zip(ks, rec, strict=True)]
    df = pd.DataFrame(rows)
    df.attrs.update(k_threshold=k_at, threshold=threshold, n_usable=len(usable), n_pairs=len(pairs))
    return df


def cv_correct(x: np.ndarray, y: np.ndarray, groups: np.ndarray, n_splits: int, C: float) -> np.ndarray | None:
    """Per-prompt correctness of grouped cross-validated predictions at each layer: [layer, n].
    None when it cannot be measured (one label class, or fewer than two groups); a fold whose
    training prompts hold one class predicts that class (chance, not an error)."""
    # deferred: scikit-learn takes about a second to import and only the probes need it
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    n_groups = len(set(groups.tolist()))
    if n_groups < 2 or len(set(y.tolist())) < 2:
        return None
    pred = np.empty((x.shape[1], len(y)), dtype=y.dtype)  # [layer, n]
    for train, test in GroupKFold(n_splits=min(n_splits, n_groups)).split(x, y, groups):
        if len(set(y[train].tolist())) < 2:
            pred[:, test] = y[train][0]
            continue
        for layer in range(x.shape[1]):
            clf = make_pipeline(StandardScaler(), LogisticRegression(C=C, max_iter=2000))
            clf.fit(x[train, layer].astype(np.float32), y[train])
            pred[layer, test] = clf.predict(x[test, layer].astype(np.float32))
    return pred == y[None]


def linear_probe(model: LoadedModel, prompts: Sequence[Prompt], labels: Sequence[Any], position: int = -1,
                 groups: Sequence[Any] | None = None, n_splits: int = 5, C: float = 1.0) -> pd.DataFrame:
    """Cross-validated accuracy of a logistic-regression probe for `labels` on the residual stream
    after each layer at `position` of each prompt (strings, message lists or ids, as `Pair`), one row
    per layer with its Wilson interval. `groups` (default: each prompt its own) keep prompts of one
    template out of each other's folds."""
    if len(prompts) != len(labels) or len(prompts) < 4:
        raise ValueError(f"a probe needs at least 4 prompts with one label each, got {len(prompts)} and {len(labels)}")
    g = np.asarray(list(groups) if groups is not None else range(len(prompts)))
    feats = [residual_stream(model, _render(model.tokenizer, p, f"prompt {i}")[1])[:, position] for i, p in enumerate(prompts)]
    x = np.stack([f.cpu().numpy() for f in feats])  # [n, layer, d_model]
    y = np.asarray(list(labels))
    ok = cv_correct(x, y, g, n_splits, C)
    if ok is None:
        raise ValueError("the probe needs two label classes and at least two groups")
    rows = []
    for layer in range(x.shape[1]):
        k = int(ok[layer].sum())
        p, lo, hi = wilson_ci(k, len(y))
        rows.append({"layer": layer, "accuracy": p, "ci_lo": lo, "ci_hi": hi, "n": len(y)})
    df = pd.DataFrame(rows)
    df.attrs.update(chance=float(max(np.mean(y == c) for c in set(y.tolist()))), position=position)
    return df
