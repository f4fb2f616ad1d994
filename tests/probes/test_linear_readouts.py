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
    assert (acc[:2] < 0.8).all() and (acc[2:] >= 0.95).all()
    rows = linear._layer_rows(ok, 5, 40, {"condition": "probe", "label": "truth", "aggregator": 0, "segment": "task"})
    assert linear.first_written(rows, 0.9) == pytest.approx(0.5)
    assert all(r["ci_lo"] <= r["accuracy"] <= r["ci_hi"] for r in rows)
    assert linear.why_unwritten(rows, [{"label_index": 0}, {"label_index": 1}], "truth", 0.9) is None


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
