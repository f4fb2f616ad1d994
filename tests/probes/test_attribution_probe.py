"""Probe `attribution` on a tiny model: records, the stored map, agreement with exact patching,
the summary's names; and `+probe=attribution` through the runner."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hydra import compose
from tiny_runs import TINY, hydra_ready  # noqa: F401

import runner.main as runner
from kvnotes import tasks
from kvnotes.edit.attribution import decode
from kvnotes.models.tiny import tiny_model
from probes import attribution


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def items(model):
    return tasks.build_suite("gated", model.tokenizer, chat=False, n_items=3, length=700, seed=0)  # the first is below the margin


def _by(records, cond):
    return [r for r in records if r.get("condition") == cond]


def test_records_map_and_agreement(model, items):
    cfg = attribution.AttributionConfig(margin=1e-3, top_k=[4, 8])
    recs = attribution.run(model, items, cfg)
    assert len(_by(recs, "item")) == len(_by(recs, "map")) == 2 and len(_by(recs, "skipped")) == 1
    for it, row, m in zip(items[1:], _by(recs, "item"), _by(recs, "map")):
        a = decode(m)
        assert a.shape == (it.n_tokens - 1, model.n_layers, model.adapter.n_kv_heads(model.hf))
        assert np.all(a.value[: it.field_span[0]] == 0)
        pos = [r for r in _by(recs, "position") if r["item_id"] == it.item_id]
        assert [r["position"] for r in pos] == list(range(it.field_span[0], it.n_tokens - 1))
        assert all(np.isfinite(r["recovery"]) for r in pos)  # exact=true: every candidate read
        assert -1 <= row["spearman_position"] <= 1 and 0 <= row["overlap_4"] <= 1
        assert row["spearman_position"] > 0.5  # a tiny model: attribution ranks like exact patching
        assert {"recovery_top4_attribution", "recovery_top4_exact", "spearman_position_layer"} <= set(row)
    s = attribution.summarize(recs, cfg)
    assert s["n_usable"] == 2 and s["spearman_position"] == pytest.approx(
        np.mean([r["spearman_position"] for r in _by(recs, "item")]))
    assert {"overlap_4", "overlap_8", "recovery_top4_attribution"} <= set(s["stats"])
    assert "recovery_top4_ratio" in s and "cost_exact_over_attribution" in s


def test_without_the_exact_map_only_the_top_is_read(model, items):
    cfg = attribution.AttributionConfig(margin=1e-3, exact=False, exact_layers=False, top_k=[3])
    recs = attribution.run(model, items[1:2], cfg)
    read = [r for r in _by(recs, "position") if np.isfinite(r["recovery"])]
    assert 3 <= len(read) <= 6  # the top 3 of each key estimate
    row = _by(recs, "item")[0]
    assert "spearman_position" not in row and "recovery_top3_attribution" in row


def test_sampled_layer_cells_estimate_the_full_map_on_the_same_draw(model, items, monkeypatch):
    """layer_cells=n reads n cells; a full run records the Spearman over the same seeded draw
    (LAYER_CHECK cells), so the two agree exactly and the summary reports the estimator's error."""
    monkeypatch.setattr(attribution, "LAYER_CHECK", 40)
    full = attribution.run(model, items[1:2], attribution.AttributionConfig(margin=1e-3, top_k=[4]))
    part = attribution.run(model, items[1:2], attribution.AttributionConfig(margin=1e-3, top_k=[4], layer_cells=40))
    f, p = _by(full, "item")[0], _by(part, "item")[0]
    assert p["n_layer_cells"] == 40 and f["n_layer_cells"] == f["n_layer_cells_all"] == p["n_layer_cells_all"] > 40
    assert "spearman_position_layer_sampled" not in p
    assert p["spearman_position_layer"] == pytest.approx(f["spearman_position_layer_sampled"], abs=1e-12)
    assert 0 <= p["worst_layer"] < model.n_layers
    s = attribution.summarize(full + full, attribution.AttributionConfig(top_k=[4]))
    assert s["layer_sample_error"]["cells"] == 40 and s["layer_sample_error"]["n"] == 2
    assert s["layer_sample_error"]["max_abs"] == pytest.approx(
        abs(f["spearman_position_layer_sampled"] - f["spearman_position_layer"]))
    assert s["stats_cluster"]["spearman_position"]["interval"] == "cluster-bootstrap"


def test_config_refuses_bad_values():
    for bad in (dict(top_k=[]), dict(top_k=[0]), dict(exact=False, exact_layers=True), dict(margin=-1.0),
                dict(layer_cells=2)):
        with pytest.raises(ValueError):
            attribution.AttributionConfig(**bad)


def test_runner_composes_and_runs_the_probe(tmp_path, tiny_llama_vocab, monkeypatch):
    import runner.context as context

    monkeypatch.setattr(context, "load", lambda cfg: tiny_llama_vocab)
    cfg = compose("config", overrides=["+probe=attribution", *TINY, f"results_dir={tmp_path}", "progress=false",
                                       "task.n_items=2", "task.length=900", "probe.margin=1e-3",
                                       "probe.exact_layers=false", "probe.top_k=[4]"])
    run_dir = runner.run(cfg)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["name"] == "attribution" and np.isfinite(summary["spearman_position"])
