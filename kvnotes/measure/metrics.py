"""Decision scores, recovery, logit agreement and bootstrap confidence intervals (pure functions).

score     = logit[new-correct] - logit[old-correct] at the decision position.
recovery  = (score_state - score_stale) / (score_oracle - score_stale): 0 behaves like the stale
            cache, 1 like the oracle; NaN (never a sentinel) when |score_oracle - score_stale| is
            below `min_denominator`, so such items are counted as skipped, not averaged in.
cosine    = <a, b> / (|a| |b|) over the full fp32 vocabulary of two next-token logit vectors.
KL        = sum_v p_ref(v) (log p_ref(v) - log p_other(v)) with p = softmax(logits) in fp32.
Aggregates carry n and a percentile bootstrap CI of the mean over the finite values
(scipy.stats.bootstrap, seeded; rows of one item, such as random draws, averaged per item
first); proportions (k successes of n) carry a Wilson score interval, which is never
zero-width (30/30 gives [0.886, 1]) and keeps inside [0, 1]. Items that share a domain or a
conversation are not independent: `cluster_bootstrap_ci` resamples whole clusters instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float
from numpy.typing import ArrayLike
from torch import Tensor

Logits = Float[Tensor, "*batch vocab"]


def score(logits: Logits, new_token: int, old_token: int) -> Float[Tensor, "*batch"]:
    """logit[new-correct] - logit[old-correct] in fp32; positive means the new-value decision."""
    x = logits.float()
    return x[..., new_token] - x[..., old_token]


def recovery(
    score_state: ArrayLike,
    score_stale: ArrayLike,
    score_oracle: ArrayLike,
    min_denominator: float = 1e-4,
) -> float | np.ndarray:
    """(state - stale) / (oracle - stale), elementwise; NaN where |oracle - stale| < min_denominator.

    Scalars in give a float out; arrays (or tensors) broadcast and give a float64 array.
    """
    state, stale, oracle = (np.asarray(_cpu(v), dtype=np.float64) for v in
                            (score_state, score_stale, score_oracle))
    denom = oracle - stale
    ok = np.abs(denom) >= min_denominator  # NaN denominators compare False: NaN out
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(ok, (state - stale) / np.where(ok, denom, 1.0), np.nan)
    return float(out) if out.ndim == 0 else out


def smallest_k(ks: Sequence[int], values: Sequence[float], threshold: float) -> float:
    """The smallest k whose value (the recovery of a set of size k) is >= threshold; NaN when
    none is. Not a search: sets need not grow better with k, so every k is read."""
    hits = [int(k) for k, v in zip(ks, values, strict=True) if np.isfinite(v) and v >= threshold]
    return float(min(hits)) if hits else float("nan")


def logit_cosine(a: Logits, b: Logits) -> Float[Tensor, "*batch"]:
    """Cosine similarity of two logit vectors over the full vocabulary, computed in fp32."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def kl_divergence(ref_logits: Logits, other_logits: Logits) -> Float[Tensor, "*batch"]:
    """KL(ref || other) in nats between the softmax distributions of two logit vectors (fp32)."""
    log_p = torch.log_softmax(ref_logits.float(), dim=-1)
    log_q = torch.log_softmax(other_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp_min(0.0)


def top1_agree(a: Logits, b: Logits) -> Bool[Tensor, "*batch"]:
    """Whether the argmax tokens of two logit vectors are the same."""
    return a.argmax(dim=-1) == b.argmax(dim=-1)


def unit_means(values: ArrayLike | Sequence[float], units: Sequence[object] | None = None) -> np.ndarray:
    """The finite values, averaged within each unit first when `units` (one label per value) is given.

    Random draws, repeats or layers of one item are not independent items: an interval over
    items must resample items, so their rows are averaged per item before the bootstrap.
    """
    x = np.asarray(_cpu(values), dtype=np.float64).ravel()
    if units is None:
        return x[np.isfinite(x)]
    labels = list(units)
    if len(labels) != x.size:
        raise ValueError(f"units has {len(labels)} labels for {x.size} values")
    sums: dict[object, list[float]] = {}
    for u, v in zip(labels, x, strict=True):
        if np.isfinite(v):
            acc = sums.setdefault(u, [0.0, 0.0])
            acc[0] += float(v)
            acc[1] += 1.0
    return np.array([a / b for a, b in sums.values()], dtype=np.float64)


def bootstrap_ci(
    values: ArrayLike | Sequence[float],
    n_boot: int = 2000,
    ci: float = 0.95,
    seed: int = 0,
    units: Sequence[object] | None = None,
) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) of the finite values: percentile bootstrap of the mean
    (scipy.stats.bootstrap, seeded), the one implementation behind summaries and the report.

    With `units`, values are averaged per unit first and n counts units. NaN and inf are
    ignored; no values gives (nan, nan, nan, 0); one value has no spread to resample and gives
    a NaN interval; identical values give a zero-width one.
    """
    if not 0.0 < ci < 1.0:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    x = unit_means(values, units)
    n = int(x.size)
    if n == 0:
        return (float("nan"), float("nan"), float("nan"), 0)
    mean = float(x.mean())
    if n == 1:
        return (mean, float("nan"), float("nan"), 1)
    if np.all(x == x[0]):
        return (mean, mean, mean, n)
    # deferred: scipy is heavy and only this path needs it
    from scipy.stats import bootstrap

    res = bootstrap((x,), np.mean, n_resamples=n_boot, confidence_level=ci, method="percentile",
                    vectorized=True, rng=np.random.default_rng(seed))
    return (mean, float(res.confidence_interval.low), float(res.confidence_interval.high), n)


def proportion_ci(
    values: ArrayLike | Sequence[float], ci: float = 0.95, units: Sequence[object] | None = None
) -> tuple[float, float, float, int]:
    """(p, lo, hi, n) of 0/1 outcomes (NaN ignored) with the Wilson interval; with `units`, one
    outcome per unit is required (a unit whose rows disagree is not a 0/1 outcome)."""
    x = unit_means(values, units)
    if not np.all((x == 0.0) | (x == 1.0)):
        raise ValueError("proportion_ci needs 0/1 outcomes (one per unit)")
    n = int(x.size)
    p, lo, hi = wilson_ci(int(x.sum()), n, ci)
    return (p, lo, hi, n)


def wilson_ci(k: int, n: int, ci: float = 0.95) -> tuple[float, float, float]:
    """(p, lo, hi): the proportion k/n with its Wilson score interval at level `ci`, from
    scipy.stats.binomtest(k, n).proportion_ci(method="wilson"):
    lo/hi = (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z the two-sided normal
    quantile. n = 0 gives (nan, nan, nan) (binomtest refuses n = 0).
    """
    if not 0.0 < ci < 1.0:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    if int(k) != k or int(n) != n or not 0 <= k <= n:
        raise ValueError(f"wilson_ci needs integers 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (float("nan"), float("nan"), float("nan"))
    # deferred: scipy.stats takes ~1 s to import and only this path needs it
    from scipy.stats import binomtest

    interval = binomtest(int(k), int(n)).proportion_ci(confidence_level=ci, method="wilson")
    return (k / n, float(interval.low), float(interval.high))


def _floats(values: Iterable[float | bool] | ArrayLike) -> np.ndarray:
    """Any array-like or iterable of numbers as one flat float64 array."""
    if hasattr(values, "__array__"):  # numpy, pandas, torch
        return np.asarray(values, dtype=np.float64).ravel()
    return np.asarray(list(values), dtype=np.float64).ravel()  # type: ignore[arg-type]  # lists, views, generators


def ci_dict(values: Iterable[float] | ArrayLike, n_boot: int = 2000,
            units: Sequence[object] | None = None) -> dict[str, float | int]:
    """Mean, 95 % percentile-bootstrap CI (bootstrap_ci) and n of the finite values, the layout
    of every summary; with `units`, rows are averaged per unit first."""
    mean, lo, hi, n = bootstrap_ci(_floats(values), n_boot=n_boot, units=units)
    return {"mean": mean, "ci_lo": lo, "ci_hi": hi, "n": n}


def prop_dict(outcomes: Iterable[float | bool] | ArrayLike, units: Sequence[object] | None = None) -> dict[str, Any]:
    """A proportion of 0/1 outcomes with its 95 % Wilson interval (never zero-width), k and n."""
    p, lo, hi, n = proportion_ci(_floats(outcomes), units=units)
    return {"mean": p, "ci_lo": lo, "ci_hi": hi, "n": n, "k": int(round(p * n)) if n else 0,
            "interval": "wilson"}


def paired_prop_diff(a: Iterable[float | bool] | ArrayLike, b: Iterable[float | bool] | ArrayLike,
                     ci: float = 0.95) -> dict[str, Any]:
    """P(a) - P(b) for paired 0/1 outcomes (a[i], b[i] of one unit) with Newcombe's hybrid score
    interval for paired data (Newcombe 1998, method 10): the two Wilson intervals combined through
    the continuity-corrected phi of the 2x2 table. Never zero-width, also when every pair agrees.

    L = d - sqrt((p1 - l1)^2 - 2 phi (p1 - l1)(u2 - p2) + (u2 - p2)^2), U likewise with the
    other ends; phi is 0 where the table has an empty margin.
    """
    x, y = _floats(a), _floats(b)
    if x.shape != y.shape:
        raise ValueError(f"paired_prop_diff needs one b per a, got {x.size} and {y.size}")
    if not (np.all((x == 0.0) | (x == 1.0)) and np.all((y == 0.0) | (y == 1.0))):
        raise ValueError("paired_prop_diff needs 0/1 outcomes")
    n = int(x.size)
    both, only_a = int(np.sum((x == 1) & (y == 1))), int(np.sum((x == 1) & (y == 0)))
    only_b, neither = int(np.sum((x == 0) & (y == 1))), int(np.sum((x == 0) & (y == 0)))
    out: dict[str, Any] = {"n": n, "both": both, "only_a": only_a, "only_b": only_b, "neither": neither,
                           "interval": "newcombe-paired"}
    if n == 0:
        return {"mean": float("nan"), "ci_lo": float("nan"), "ci_hi": float("nan"), **out}
    p1, l1, u1 = wilson_ci(both + only_a, n, ci)
    p2, l2, u2 = wilson_ci(both + only_b, n, ci)
    margins = float(both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    cross = both * neither - only_a * only_b
    phi = 0.0 if margins == 0 else (max(cross - n / 2.0, 0.0) if cross > 0 else float(cross)) / np.sqrt(margins)
    d = p1 - p2
    lo = d - np.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    hi = d + np.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return {"mean": float(d), "ci_lo": float(max(lo, -1.0)), "ci_hi": float(min(hi, 1.0)), **out}


def cluster_bootstrap_ci(values: ArrayLike | Sequence[float], clusters: Sequence[object],
                         n_boot: int = 2000, ci: float = 0.95, seed: int = 0) -> dict[str, Any]:
    """Mean of the finite values with a 95 % percentile interval from resampling whole clusters
    with replacement (seeded, deterministic): each draw takes G of the G clusters and the pooled
    mean of their items, sum(S_g) / sum(N_g). Items of one cluster (a domain, a conversation)
    move together, so shared templates widen the interval as they should. Fewer than two
    clusters have no between-cluster spread: a NaN interval with the reason in `why`.
    """
    if not 0.0 < ci < 1.0 or n_boot < 1:
        raise ValueError(f"ci in (0, 1) and n_boot >= 1, got ci={ci}, n_boot={n_boot}")
    x = np.asarray(_cpu(values), dtype=np.float64).ravel()
    labels = list(clusters)
    if len(labels) != x.size:
        raise ValueError(f"clusters has {len(labels)} labels for {x.size} values")
    keep = np.isfinite(x)
    x, labels = x[keep], [c for c, k in zip(labels, keep, strict=True) if k]
    names = sorted(set(map(str, labels)))
    out: dict[str, Any] = {"mean": float(x.mean()) if x.size else float("nan"), "ci_lo": float("nan"),
                           "ci_hi": float("nan"), "n": int(x.size), "n_clusters": len(names),
                           "interval": "cluster-bootstrap"}
    if len(names) < 2:
        return out | {"why": f"{len(names)} cluster: no between-cluster spread to resample"}
    idx = np.array([names.index(str(c)) for c in labels])
    sums, counts = np.bincount(idx, x, len(names)), np.bincount(idx, minlength=len(names)).astype(np.float64)
    draw = np.random.default_rng(seed).integers(0, len(names), size=(n_boot, len(names)))  # [boot, G]
    means = sums[draw].sum(1) / counts[draw].sum(1)  # [boot]: pooled mean of the drawn clusters
    lo, hi = np.quantile(means, [(1 - ci) / 2, (1 + ci) / 2])
    return out | {"ci_lo": float(lo), "ci_hi": float(hi)}


def wider(a: Mapping[str, Any], b: Mapping[str, Any]) -> Mapping[str, Any]:
    """Of two intervals (dicts with ci_lo, ci_hi), the wider; a NaN interval never wins."""
    def width(d: Mapping[str, Any]) -> float:
        w = float(d.get("ci_hi", np.nan)) - float(d.get("ci_lo", np.nan))
        return w if np.isfinite(w) else -1.0
    return b if width(b) > width(a) else a


def flipped_back(score: ArrayLike, score_stale: ArrayLike, score_oracle: ArrayLike,
                 offset: ArrayLike = 0.0) -> np.ndarray:
    """Whether each decision went back to the old answer: 1.0 when score - offset lies on the
    stale side of 0, 0.0 when not, NaN where stale and oracle decide alike (nothing to go back to:
    sign(stale - offset) == sign(oracle - offset)). The decision is the pairwise one of the score
    (new-correct vs old-correct); `offset` is the content-free score for a calibrated decision."""
    s, st, o, c = (np.asarray(_cpu(v), dtype=np.float64) for v in (score, score_stale, score_oracle, offset))
    side_stale, side_oracle = np.sign(st - c), np.sign(o - c)
    ok = (side_stale != side_oracle) & (side_stale != 0) & (side_oracle != 0) & np.isfinite(s)
    return np.atleast_1d(np.where(ok, (np.sign(s - c) == side_stale).astype(np.float64), np.nan))


def raw_p_correct(score: ArrayLike, score_stale: ArrayLike, score_oracle: ArrayLike,
                  usable_recovery: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(usable, correct) of the uncalibrated P(correct), per record, from the item's scores alone.

    Every task suite of kvnotes.tasks decides between two outcomes, so an item's raw argmax (no
    content-free offset) is the sign of score = logit[correct_new] - logit[correct_old]: the state picks the new answer when
    score > 0. An item is usable, as for the calibrated reading, when it is usable for recovery
    (|score_oracle - score_stale| >= margin) and the stale prompt picks the old answer
    (score_stale < 0) while the oracle picks the new one (score_oracle > 0); a state is correct
    when it picks what the oracle picks, the new answer (score > 0). A score of exactly 0 (a tie)
    counts as neither answer.
    """
    s, st, o = (np.asarray(_cpu(v), dtype=np.float64) for v in (score, score_stale, score_oracle))
    usable = np.asarray(usable_recovery, dtype=bool) & (st < 0) & (o > 0)
    return np.atleast_1d(usable), np.atleast_1d(s > 0)


def range_dict(values: Iterable[float] | ArrayLike) -> dict[str, Any]:
    """Timings: mean, median, min and max of the finite values, called a min-max range (one timing
    per item is no sample to bootstrap a 95 % interval from)."""
    x = _floats(values)
    x = x[np.isfinite(x)]
    if not x.size:
        return {"mean": float("nan"), "median": float("nan"), "min": float("nan"), "max": float("nan"),
                "n": 0, "interval": "min-max"}
    return {"mean": float(x.mean()), "median": float(np.median(x)), "min": float(x.min()),
            "max": float(x.max()), "n": int(x.size), "interval": "min-max"}


def _cpu(v: object) -> object:
    """Tensors to CPU numpy (other inputs unchanged), so numpy functions accept them."""
    if isinstance(v, Tensor):
        return v.detach().to(torch.float64).cpu().numpy()
    return v
