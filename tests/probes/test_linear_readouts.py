"""Probe linear's readouts on synthetic residuals (known answers) and on a tiny model: grouped CV
per layer, both label sources, every aggregator, and why a write depth is missing."""

import math

import numpy as np
import pytest

from kvnotes import tasks
from kvnotes.models.tiny import tiny_model
from probes import linear


def synthetic(n=40, layers=5, d=8, written_from=2, seed=0):
    """Residuals whose label is linearly readable from layer `written_from` on, noise before."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 2
    x = rng.normal(size=(n, layers, d))
    x[:, written_from:, 0] += 6.0 * (2 * y[:, None] - 1)
    groups = np.array([f"t{i // 4}" for i in range(n)])  # 10 templates, both labels in each
    return x, y, groups


def test_grouped_cv_finds_the_layer_where_the_label_is_written():
    x, y, groups = synthetic()
    ok = linear.cv_correct(x, y, groups, n_splits=5, C=1.0)
    acc = ok.mean(1)
    assert ok.shape == (5, 40)
    assert (acc[:2] < 0.8).all() and (acc[2:] == 1.0).all()  # a shift of 6 sd: separable
    rows = linear._layer_rows(ok, 5, 40, {"condition": "probe", "label": "truth", "aggregator": 0, "segment": "task"})
    assert linear.first_written(rows, 0.9) == pytest.approx(0.5)
    assert [r["rel_layer"] for r in rows] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert all(r["ci_lo"] <= r["accuracy"] <= r["ci_hi"] for r in rows)
    assert linear.why_unwritten(rows, [{"label_index": 0}, {"label_index": 1}], "truth", 0.9) is None


Z95 = 1.959963984540054  # two-sided 95 % normal quantile


def wilson(k: int, n: int) -> tuple[float, float]:
    """The Wilson score interval of k successes in n, written out."""
    p, z2 = k / n, Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return centre - half, centre + half


def test_layer_intervals_are_wilson_proportion_intervals_and_never_zero_width():
    x, y, groups = synthetic()
    ok = linear.cv_correct(x, y, groups, n_splits=5, C=1.0)
    rows = linear._layer_rows(ok, 5, 40, {"condition": "layer"})
    for layer, r in enumerate(rows):
        k = int(ok[layer].sum())
        assert (r["layer"], r["n_correct"], r["n_prompts"]) == (layer, k, 40)
        assert r["accuracy"] == pytest.approx(k / 40)
        lo, hi = wilson(k, 40)
        assert r["ci_lo"] == pytest.approx(max(lo, 0.0), abs=1e-12)
        assert r["ci_hi"] == pytest.approx(min(hi, 1.0), abs=1e-12)
        assert r["ci_hi"] - r["ci_lo"] > 0.05  # 40 prompts: never a zero-width interval
    perfect = rows[-1]  # 40 / 40: the interval still reaches below 1
    assert perfect["accuracy"] == perfect["ci_hi"] == 1.0
    assert perfect["ci_lo"] == pytest.approx(40 / (40 + Z95**2), abs=1e-9)  # Wilson at k = n


def test_pure_noise_is_read_at_chance():
    rng = np.random.default_rng(7)
    n = 200
    x = rng.normal(size=(n, 6, 8))  # no label anywhere
    y = np.arange(n) % 2
    groups = np.array([f"t{i // 4}" for i in range(n)])
    acc = np.array(linear.layer_accuracy(x, y, groups, linear.LinearConfig()))
    assert acc.shape == (6,) and abs(acc.mean() - 0.5) < 0.05 and ((acc > 0.35) & (acc < 0.65)).all()
    rows = linear._layer_rows(linear.cv_correct(x, y, groups, 5, 1.0), 6, n, {})
    assert math.isnan(linear.first_written(rows, 0.9))  # never written


def test_grouped_cv_never_trains_on_a_held_out_template(monkeypatch):
    """Every fit is spied on: the prompts it predicts come from templates it never saw."""
    import sklearn.pipeline

    x, y, _ = synthetic(n=48, layers=2)
    groups = np.array([f"t{(i // 2) % 12}" for i in range(48)])  # interleaved: 0, 1, 24, 25 -> t0
    x[:, :, -1] = np.arange(48)[:, None]  # a prompt id in the last feature, to trace rows
    calls: list[tuple[str, set[int]]] = []
    real = sklearn.pipeline.make_pipeline

    class Spy:
        def __init__(self, *steps):
            self.pipe = real(*steps)

        def fit(self, xs, ys):
            calls.append(("fit", {int(round(v)) for v in xs[:, -1]}))
            self.pipe.fit(xs, ys)
            return self

        def predict(self, xs):
            calls.append(("predict", {int(round(v)) for v in xs[:, -1]}))
            return self.pipe.predict(xs)

    monkeypatch.setattr(sklearn.pipeline, "make_pipeline", Spy)
    ok = linear.cv_correct(x, y, groups, n_splits=4, C=1.0)
    assert ok is not None and ok.shape == (2, 48)
    pairs = list(zip(calls[::2], calls[1::2]))
    assert len(pairs) == 4 * 2  # 4 folds x 2 layers, each one fit then one predict
    predicted: list[int] = []
    for (kind_fit, train), (kind_pred, test) in pairs:
        assert (kind_fit, kind_pred) == ("fit", "predict")
        assert {groups[i] for i in train}.isdisjoint({groups[i] for i in test})
        assert train | test == set(range(48))
        predicted += sorted(test)
    assert sorted(predicted) == sorted(list(range(48)) * 2)  # each prompt held out once per layer


def test_a_template_fingerprint_does_not_leak_the_label():
    """One-hot template features and labels constant within a template: an ungrouped split would
    read the label off the fingerprint (accuracy 1); held-out templates' columns are zero in
    training, so the grouped probe predicts one class per fold and cannot beat 0.5."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import KFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    g = np.random.default_rng(3).permutation(np.repeat(np.arange(20), 4))  # 20 templates of 4, interleaved
    y = g % 2
    x = np.zeros((80, 3, 20))
    x[np.arange(80), :, g] = 1.0  # [prompt, layer, template one-hot]
    groups = np.array([f"t{i}" for i in g])
    ok = linear.cv_correct(x, y, groups, n_splits=5, C=1.0)
    assert ok is not None and ok.mean(1).max() <= 0.5
    leaky = [make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
             .fit(x[tr, 0], y[tr]).predict(x[te, 0]) == y[te]
             for tr, te in KFold(5, shuffle=True, random_state=0).split(x)]
    assert np.concatenate(leaky).mean() == 1.0  # the fingerprint does carry the label


def test_unmeasurable_accuracy_is_nan_not_chance():
    x, y, groups = synthetic()
    assert linear.cv_correct(x, np.zeros_like(y), groups, 5, 1.0) is None  # one class
    assert linear.cv_correct(x, y, np.array(["one"] * 40), 5, 1.0) is None  # one template
    cfg = linear.LinearConfig()
    assert all(math.isnan(a) for a in linear.layer_accuracy(x, y, np.array(["one"] * 40), cfg))


def test_a_fold_trained_on_one_class_predicts_it_instead_of_failing():
    x, y, groups = synthetic()
    y = np.zeros_like(y)
    y[groups == "t0"] = 1  # the only positives sit in one template: its held-out fold trains on zeros
    ok = linear.cv_correct(x, y, groups, n_splits=5, C=1.0)
    assert ok.shape == (5, 40) and not ok[:, groups == "t0"].any()  # predicted 0, labelled 1


def test_why_no_write_depth_says_how_close_and_where():
    x, y, groups = synthetic(written_from=5)  # never written
    ok = linear.cv_correct(x, y, groups, 5, 1.0)
    rows = linear._layer_rows(ok, 5, 40, {"condition": "probe", "label": "model", "aggregator": 3, "segment": "rule"})
    prompts = [{"label_index": i % 2, "model_label_index": i % 2, "final_pick": "a"} for i in range(40)]
    why = linear.why_unwritten(rows, prompts, "model", 0.9)
    assert why.startswith("model labels: accuracy never reaches 0.9; best")
    assert "aggregator 3 from the last (rule)" in why and "n = 40 prompts, classes 20 / 20" in why
    one_class = [{"label_index": i % 2, "model_label_index": 0, "final_pick": "escalate"} for i in range(40)]
    assert "single class (escalate" in linear.why_unwritten(rows, one_class, "model", 0.9)


def test_config_refuses_unknown_labels():
    with pytest.raises(ValueError, match="valid: truth, model"):
        linear.LinearConfig(labels=["field"])


def test_tiny_model_probes_every_aggregator_with_both_labels(one_thread):
    model = tiny_model("llama")
    items = tasks.build_suite("gated-polarity", model.tokenizer, chat=False, n_items=6, length=700, seed=0)
    cfg = linear.LinearConfig(n_splits=2, max_aggregators=3)
    recs = linear.run(model, items, cfg)
    probe = [r for r in recs if r["condition"] == "probe"]
    assert {(r["label"], r["aggregator"]) for r in probe} == {(lab, j) for lab in ("truth", "model") for j in range(3)}
    frac = {j: next(r["downstream_frac"] for r in probe if r["aggregator"] == j) for j in range(3)}
    assert 1 >= frac[0] > frac[1] > frac[2] > 0  # rank 0 is the last aggregator before the decision
    by_id = {it.item_id: it for it in items}
    for r in (r for r in recs if r["condition"] == "prompt"):
        assert by_id[r["item_id"]].outcomes[r["model_label_index"]] == r["final_pick"]
    s = linear.summarize(recs, cfg)
    for lab in ("truth", "model"):
        best = s["labels"][lab]
        assert len(best["accuracy_best"]) == len(best["accuracy_mean_over_aggregators"]) == model.n_layers
        assert math.isnan(best["write_depth_best"]) == (best["why_no_write_depth"] is not None)
    layer = [r for r in recs if r["condition"] == "layer"]  # the headline rows the report reads
    assert len(layer) == model.n_layers and all(r["label"] == "truth" for r in layer)
    n = 2 * len(items)  # old and new prompt of each item
    for r in layer:
        assert r["n_prompts"] == n and r["accuracy"] == pytest.approx(r["n_correct"] / n)
        lo, hi = wilson(r["n_correct"], n)
        assert (r["ci_lo"], r["ci_hi"]) == pytest.approx((max(lo, 0.0), min(hi, 1.0)), abs=1e-12)
    mean_rows = [r for r in recs if r["condition"] == "probe_mean"]
    assert mean_rows  # truth labels are balanced by design: measurable at every rank
    for r in mean_rows:  # the mean over aggregators is the mean of the per-rank accuracies
        ranks = [p["accuracy"] for p in probe if p["label"] == r["label"] and p["layer"] == r["layer"]]
        assert len(ranks) == 3 and r["accuracy"] == pytest.approx(float(np.mean(ranks)))


def test_aggregator_features_past_float16_range_are_kept_finite_and_exact_to_its_precision():
    import torch

    x = torch.randn(3, 4, 16, dtype=torch.float64)
    x[:, 2] *= 1e6  # gemma-3's residual stream reaches 1e5: float16 alone overflows to inf
    x[:, 3] *= 1e-3
    f16, scale = linear.fp16_scaled(x)
    assert f16.dtype == np.float16 and np.isfinite(f16).all()
    assert scale[0] == 1.0 and scale[3] == 1.0 and scale[2] > 1 and np.log2(scale[2]) == int(np.log2(scale[2]))
    p = linear.Prompt({}, np.zeros((4, 16)), f16, [], scale)
    back = np.stack([p.agg(j) for j in range(3)])
    assert np.allclose(back, x.numpy(), rtol=2 ** -10, atol=1e-7)
    empty, s0 = linear.fp16_scaled(torch.zeros(0, 4, 16))
    assert empty.shape == (0, 4, 16) and (s0 == 1).all()
