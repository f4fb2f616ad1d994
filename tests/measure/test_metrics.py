"""kvnotes.measure.metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvnotes.measure.metrics import (
    bootstrap_ci,
    cluster_bootstrap_ci,
    flipped_back,
    kl_divergence,
    logit_cosine,
    proportion_ci,
    recovery,
    score,
    top1_agree,
    wider,
    wilson_ci,
)


def test_score_is_new_minus_old_logit():
    logits = torch.tensor([[1.0, 4.0, -2.0], [0.5, 0.0, 3.0]])
    assert score(logits, new_token=1, old_token=2).tolist() == [6.0, -3.0]


def test_score_is_fp32_for_half_logits():
    logits = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert score(logits, 1, 0).dtype == torch.float32


def test_recovery_anchors_stale_zero_oracle_one():
    assert recovery(-2.0, -2.0, 3.0) == 0.0
    assert recovery(3.0, -2.0, 3.0) == 1.0
    assert recovery(0.5, -2.0, 3.0) == pytest.approx(0.5)
    assert recovery(-4.5, -2.0, 3.0) == pytest.approx(-0.5)  # worse than stale is negative


def test_recovery_is_nan_below_min_denominator():
    assert math.isnan(recovery(1.0, 1.0, 1.0 + 5e-5))
    assert math.isnan(recovery(1.0, 1.0, 1.0 + 0.05, min_denominator=0.1))
    assert recovery(1.0, 0.0, 1e-3, min_denominator=1e-4) == pytest.approx(1000.0)


def test_recovery_broadcasts_arrays_and_tensors():
    out = recovery(torch.tensor([1.0, 2.0, 5.0]), 0.0, torch.tensor([2.0, 0.0, 10.0]))
    assert isinstance(out, np.ndarray)
    assert out[0] == 0.5 and math.isnan(out[1]) and out[2] == 0.5


def test_recovery_propagates_nan_scores():
    assert math.isnan(recovery(float("nan"), 0.0, 1.0))
    assert math.isnan(recovery(0.5, 0.0, float("nan")))


def test_cosine_identical_scaled_and_opposite():
    a = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(logit_cosine(a, a), torch.ones(3), atol=1e-6)
    assert torch.allclose(logit_cosine(a, 2 * a), torch.ones(3), atol=1e-6)
    assert torch.allclose(logit_cosine(a, -a), -torch.ones(3), atol=1e-6)
    assert logit_cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item() == 0.0


def test_cosine_upcasts_half_precision():
    a = torch.randn(1000, dtype=torch.float16)
    assert logit_cosine(a, a).dtype == torch.float32


def test_kl_zero_for_identical_and_shift_invariant():
    a = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(kl_divergence(a, a), torch.zeros(4), atol=1e-6)
    assert torch.allclose(kl_divergence(a, a + 7.0), torch.zeros(4), atol=1e-5)


def test_kl_known_value_and_direction():
    p = torch.tensor([0.5, 0.5]).log()
    q = torch.tensor([0.9, 0.1]).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p, q).item() == pytest.approx(expected, rel=1e-5)
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_divergence(q, p).item() == pytest.approx(reverse, rel=1e-5)


def test_top1_agree():
    a = torch.tensor([[0.1, 0.9, 0.0], [1.0, 0.0, 0.0]])
    b = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 2.0]])
    assert top1_agree(a, b).tolist() == [True, False]


def test_bootstrap_ci_contains_mean_and_is_seeded():
    values = np.random.default_rng(0).normal(1.0, 0.5, size=200)
    mean, lo, hi, n = bootstrap_ci(values, n_boot=500, seed=3)
    assert n == 200 and mean == pytest.approx(values.mean())
    assert lo < mean < hi
    assert hi - lo == pytest.approx(2 * 1.96 * 0.5 / np.sqrt(200), rel=0.25)
    assert bootstrap_ci(values, n_boot=500, seed=3) == (mean, lo, hi, n)


def test_bootstrap_ci_ignores_nan_and_handles_empty():
    mean, lo, hi, n = bootstrap_ci([1.0, float("nan"), 3.0, float("inf")])
    assert (mean, n) == (2.0, 2) and 1.0 <= lo <= hi <= 3.0
    m, lo, hi, n = bootstrap_ci([7.0])  # one value: no spread to resample, no interval
    assert (m, n) == (7.0, 1) and math.isnan(lo) and math.isnan(hi)
    assert bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0, 3)
    mean, lo, hi, n = bootstrap_ci([float("nan")])
    assert n == 0 and all(math.isnan(v) for v in (mean, lo, hi))


def test_bootstrap_ci_wider_at_higher_level():
    values = np.arange(50, dtype=float)
    _, lo90, hi90, _ = bootstrap_ci(values, ci=0.90)
    _, lo99, hi99, _ = bootstrap_ci(values, ci=0.99)
    assert lo99 < lo90 and hi99 > hi90
    with pytest.raises(ValueError):
        bootstrap_ci(values, ci=1.5)


def test_wilson_ci_known_values_and_never_zero_width():
    p, lo, hi = wilson_ci(30, 30)
    assert p == 1.0 and hi == 1.0 and lo == pytest.approx(0.8865, abs=1e-4)  # not [1, 1]
    p, lo, hi = wilson_ci(0, 30)
    assert p == 0.0 and lo == 0.0 and hi == pytest.approx(0.1135, abs=1e-4)
    p, lo, hi = wilson_ci(7, 10)  # textbook: 0.397 .. 0.892
    assert p == 0.7 and lo == pytest.approx(0.3968, abs=1e-3) and hi == pytest.approx(0.8922, abs=1e-3)
    assert all(math.isnan(v) for v in wilson_ci(0, 0))


def test_wilson_ci_narrows_with_n_and_rejects_bad_counts():
    _, lo1, hi1 = wilson_ci(5, 10)
    _, lo2, hi2 = wilson_ci(50, 100)
    assert hi2 - lo2 < hi1 - lo1
    _, lo90, hi90 = wilson_ci(5, 10, ci=0.90)
    assert lo90 > lo1 and hi90 < hi1
    for k, n in ((11, 10), (-1, 10), (1.5, 10)):
        with pytest.raises(ValueError):
            wilson_ci(k, n)


def test_bootstrap_ci_is_scipy_percentile_over_units():
    from scipy.stats import bootstrap

    x = np.random.default_rng(5).normal(0.0, 1.0, 25)
    ref = bootstrap((x,), np.mean, n_resamples=2000, method="percentile", vectorized=True,
                    rng=np.random.default_rng(0)).confidence_interval
    assert bootstrap_ci(x)[1:3] == (ref.low, ref.high)
    # units: the rows of one unit are averaged first, n counts units
    mean, _, _, n = bootstrap_ci([0.0, 0.0, 0.9, 0.9, float("nan")], units=["a", "a", "a", "b", "b"])
    assert n == 2 and mean == pytest.approx((0.3 + 0.9) / 2)
    with pytest.raises(ValueError, match="labels"):
        bootstrap_ci([1.0, 2.0], units=["a"])


def test_proportion_ci_is_wilson_over_0_1_outcomes():
    p, lo, hi, n = proportion_ci([1.0] * 29 + [0.0, float("nan")])
    assert (p, n) == (pytest.approx(29 / 30), 30) and (lo, hi) == wilson_ci(29, 30)[1:]
    with pytest.raises(ValueError, match="0/1"):
        proportion_ci([0.5])


def test_paired_prop_diff_never_zero_width_and_mirrors():
    from kvnotes.measure.metrics import paired_prop_diff

    tie = paired_prop_diff([1] * 8, [1] * 8)  # every pair agrees: the difference is 0, not known to be 0
    assert tie["mean"] == 0.0 and tie["ci_lo"] < -0.2 and tie["ci_hi"] > 0.2
    a = [1, 1, 0, 0, 0, 0, 0, 0, 0] + [0] * 12
    b = [1, 0, 1, 1, 1, 1, 1, 1, 1] + [0] * 12
    d, r = paired_prop_diff(a, b), paired_prop_diff(b, a)
    assert (d["both"], d["only_a"], d["only_b"], d["neither"]) == (1, 1, 7, 12)
    assert d["mean"] == pytest.approx(-6 / 21) and d["ci_lo"] < d["mean"] < d["ci_hi"] < 0
    assert (r["ci_lo"], r["ci_hi"]) == pytest.approx((-d["ci_hi"], -d["ci_lo"]))
    with pytest.raises(ValueError, match="one b per a"):
        paired_prop_diff([1, 0], [1])
    with pytest.raises(ValueError, match="0/1"):
        paired_prop_diff([0.5], [1])


@pytest.mark.parametrize("cells", [(0.45, 0.05, 0.15, 0.35), (0.8, 0.1, 0.05, 0.05), (0.25, 0.25, 0.25, 0.25)])
def test_paired_prop_diff_covers_at_nominal_level(cells):
    """Coverage of the true P(a) - P(b) over 1,000 simulated tables of 30 correlated pairs: Newcombe's
    method 10 stays near 95 %."""
    from kvnotes.measure.metrics import paired_prop_diff

    rng = np.random.default_rng(0)
    truth = cells[1] - cells[2]
    pairs = np.array([(1, 1), (1, 0), (0, 1), (0, 0)])
    hits = 0
    for _ in range(1000):
        ab = pairs[rng.choice(4, size=30, p=cells)]
        d = paired_prop_diff(ab[:, 0], ab[:, 1])
        hits += d["ci_lo"] <= truth <= d["ci_hi"]
    assert hits / 1000 >= 0.93


def _wilson_closed_form(k: int, n: int, ci: float) -> tuple[float, float, float]:
    """The hand-written interval wilson_ci used to compute (the reference for the grid below)."""
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + ci / 2.0))
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4.0 * n * n)) / denom
    return p, (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def test_wilson_ci_is_scipys_binomtest_interval_and_equals_the_closed_form_on_a_grid(monkeypatch):
    import scipy.stats

    for n in (1, 2, 3, 7, 10, 30, 59, 200, 1000):
        for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
            for ci in (0.5, 0.8, 0.9, 0.95, 0.99):
                got, want = wilson_ci(k, n, ci), _wilson_closed_form(k, n, ci)
                assert np.allclose(got, want, rtol=0, atol=1e-12), (k, n, ci, got, want)
    calls = []
    real = scipy.stats.binomtest
    monkeypatch.setattr(scipy.stats, "binomtest", lambda k, n: calls.append((k, n)) or real(k, n))
    wilson_ci(3, 7)
    assert calls == [(3, 7)]  # the maintained implementation, not a copy of its formula


# --- cluster bootstrap and decision flips (#31) ---------------------------------------------------


def test_cluster_bootstrap_wider_than_item_bootstrap_when_clusters_are_copies():
    # 6 domains, 10 identical items each: 60 "items" but only 6 independent values
    per_domain = [0.0, 0.1, 0.5, 0.2, 0.9, 0.3]
    values = [v for v in per_domain for _ in range(10)]
    clusters = [d for d in range(6) for _ in range(10)]
    item = bootstrap_ci(values)
    cl = cluster_bootstrap_ci(values, clusters)
    assert cl["n"] == 60 and cl["n_clusters"] == 6 and cl["mean"] == pytest.approx(item[0])
    assert (cl["ci_hi"] - cl["ci_lo"]) > 2 * (item[2] - item[1])
    assert cl == cluster_bootstrap_ci(values, clusters)  # seeded: deterministic


def test_cluster_bootstrap_pools_items_of_unequal_clusters():
    out = cluster_bootstrap_ci([1.0, 1.0, 1.0, 0.0, float("nan")], ["a", "a", "a", "b", "b"])
    assert out["mean"] == pytest.approx(0.75) and out["n"] == 4 and out["n_clusters"] == 2
    assert 0.0 <= out["ci_lo"] < 0.75 < out["ci_hi"] <= 1.0


def test_cluster_bootstrap_one_cluster_gives_nan_with_a_reason():
    out = cluster_bootstrap_ci([0.1, 0.2, 0.3], ["a", "a", "a"])
    assert math.isnan(out["ci_lo"]) and math.isnan(out["ci_hi"]) and "1 cluster" in out["why"]
    with pytest.raises(ValueError, match="labels"):
        cluster_bootstrap_ci([0.1, 0.2], ["a"])


def test_wider_picks_the_wider_finite_interval():
    a, b = {"ci_lo": 0.1, "ci_hi": 0.2}, {"ci_lo": 0.0, "ci_hi": 0.3}
    assert wider(a, b) is b and wider(b, a) is b
    assert wider(a, {"ci_lo": float("nan"), "ci_hi": float("nan")}) is a


def test_flipped_back_reads_the_decision_side():
    # stale -1 (old answer), oracle +2 (new answer): a score below 0 went back
    out = flipped_back([-0.5, 0.5, 3.0, -2.0], [-1.0] * 4, [2.0] * 4)
    assert out.tolist() == [1.0, 0.0, 0.0, 1.0]
    # stale and oracle on the same side: nothing to go back to
    assert math.isnan(flipped_back(-1.0, 0.5, 2.0)[0])
    # calibrated: the threshold moves to the content-free score
    assert flipped_back(0.5, 0.5, 4.0, offset=1.0).tolist() == [1.0]
