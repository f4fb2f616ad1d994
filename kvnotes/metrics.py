"""Decision scores, recovery, logit agreement and bootstrap confidence intervals (pure functions).

score     = logit[new-correct] - logit[old-correct] at the decision position.
recovery  = (score_state - score_stale) / (score_oracle - score_stale): 0 behaves like the stale
            cache, 1 like the oracle; NaN (never a sentinel) when |score_oracle - score_stale| is
            below `min_denominator`, so such items are counted as skipped, not averaged in.
cosine    = <a, b> / (|a| |b|) over the full fp32 vocabulary of two next-token logit vectors.
KL        = sum_v p_ref(v) (log p_ref(v) - log p_other(v)) with p = softmax(logits) in fp32.
Aggregates carry n and a percentile bootstrap CI of the mean over the finite values;
proportions (k successes of n) carry a Wilson score interval, which is never zero-width
(30/30 gives [0.886, 1]) and keeps inside [0, 1].
"""

from __future__ import annotations

from collections.abc import Sequence

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


def bootstrap_ci(
    values: ArrayLike | Sequence[float],
    n_boot: int = 1000,
    ci: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) of the finite values; percentile bootstrap of the mean, seeded.

    NaN and inf are ignored (n counts what is left); no values gives (nan, nan, nan, 0).
    """
    if not 0.0 < ci < 1.0:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    x = np.asarray(_cpu(values), dtype=np.float64).ravel()
    x = x[np.isfinite(x)]
    n = int(x.size)
    if n == 0:
        return (float("nan"), float("nan"), float("nan"), 0)
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    chunk = max(1, 2_000_000 // n)  # resample in chunks: at most ~2M draws in memory at once
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))  # [boot, n]
        means[start:stop] = x[idx].mean(axis=1)
    alpha = (1.0 - ci) / 2.0
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return (float(x.mean()), float(lo), float(hi), n)


def wilson_ci(k: int, n: int, ci: float = 0.95) -> tuple[float, float, float]:
    """(p, lo, hi): the proportion k/n with its Wilson score interval at level `ci`.

    lo/hi = (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z the two-sided normal
    quantile. n = 0 gives (nan, nan, nan).
    """
    if not 0.0 < ci < 1.0:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    if int(k) != k or int(n) != n or not 0 <= k <= n:
        raise ValueError(f"wilson_ci needs integers 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (float("nan"), float("nan"), float("nan"))
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + ci / 2.0))
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n)) / denom
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact ends (rounding gives 1 - 1e-16)
    hi = 1.0 if k == n else min(1.0, centre + half)
    return (float(p), float(lo), float(hi))


def _cpu(v: object) -> object:
    """Tensors to CPU numpy (other inputs unchanged), so numpy functions accept them."""
    if isinstance(v, Tensor):
        return v.detach().to(torch.float64).cpu().numpy()
    return v
