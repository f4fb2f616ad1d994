"""The four probes on a tiny model: records, identities, skips and summaries."""

import math

import pytest

from kvnotes import tasks
from kvnotes.models.tiny import tiny_model
from probes import knockout, linear, suffix
from probes import patching as locality


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def items(model):
    return tasks.build_suite("gated", model.tokenizer, chat=False, n_items=2, length=700, seed=0)


def _by(records, cond):
    return [r for r in records if r.get("condition") == cond]


def test_patching_identities(model, items):
    cfg = locality.PatchingConfig(margin=0.0)
    recs = locality.run(model, items, cfg)
    for item in items:
        rows = {r["condition"]: r for r in recs if r["item_id"] == item.item_id and "position" not in r or
                (r["item_id"] == item.item_id and r["condition"] in locality.CONDITIONS)}
        # positions before the field hold identical K/V: patching from the field on is the oracle
        assert rows["full_downstream"]["score"] == pytest.approx(rows["oracle"]["score"], abs=1e-5)
        assert rows["stale"]["score"] == pytest.approx(rows["stale"]["score_stale"], abs=1e-5)
    pos = _by(recs, "position")
    assert {r["position"] for r in pos} >= set(range(items[0].field_span[0], items[0].n_tokens - 1))
    assert len(_by(recs, "layer")) == 2 * model.n_layers
    s = locality.summarize(recs, cfg)
    assert s["n_usable"] == 2 and set(s["recovery"]) == set(locality.CONDITIONS)


def test_margin_skips_and_says_why(model, items):
    recs = locality.run(model, items, locality.PatchingConfig(margin=1e9))
    assert [r["condition"] for r in recs] == ["skipped", "skipped"]
    s = locality.summarize(recs, locality.PatchingConfig())
    assert s["n_skipped"] == 2 and s["margin"] == 1e9 and s["skip_reasons"]


def test_suffix_curves_end_at_full_downstream(model, items):
    recs = suffix.run(model, items, suffix.SuffixConfig(margin=0.0, top_k=[1, 2], n_random=2))
    for item in items:
        rows = [r for r in recs if r["item_id"] == item.item_id]
        last = [r for r in rows if r["condition"] in ("suffix", "prefix") and r["k"] == 100]
        assert last[0]["score"] == pytest.approx(last[1]["score"], abs=1e-5)  # 100 % is 100 %
    s = suffix.summarize(recs, suffix.SuffixConfig())
    assert [c["k"] for c in s["suffix"]] == suffix.K_PERCENT
    assert len(_by(recs, "randomk")) == 2 * 2 * 2  # items x k x draws


def test_knockout_records(model, items):
    cfg = knockout.KnockoutConfig(margin=0.0, n_random=1, head_ks=[1, 2])
    recs = knockout.run(model, items, cfg)
    mass = _by(recs, "mass")[0]
    total = mass["mass_field"] + mass["mass_downstream"] + mass["mass_sink"] + mass["mass_other"] + mass["mass_self"]
    assert total == pytest.approx(1.0, abs=1e-4)
    assert {r["variant"] for r in _by(recs, "top")} == {"decision", "after_notes"}
    assert {r["variant"] for r in _by(recs, "band")} == {"decision"}  # layer thirds: decision token only
    s = knockout.summarize(recs, cfg)
    assert {b["band"] for b in s["bands"]} == {"early", "mid", "late", "all"}
    assert set(s["reverts_reproduced_by"]) <= {"decision", "after_notes"} and "median" in s["reverts_rule"]
    assert {p["n_heads"] for p in s["heads"]["curves"]["attention"]} == {1, 2, 12}


def test_linear_probe_runs_and_reports_depths(model):
    its = tasks.build_suite("gated-polarity", model.tokenizer, chat=False, n_items=6, length=700, seed=0)
    cfg = linear.LinearConfig(n_splits=2, max_aggregators=2)
    recs = linear.run(model, its, cfg)
    s = linear.summarize(recs, cfg)
    assert s["n_prompts"] == 12 and len(s["accuracy_by_layer"]) == model.n_layers
    assert math.isnan(s["write_depth"]) or 0 <= s["write_depth"] <= 1
    assert 0 <= s["commit_depth"]["mean"] <= 1
    assert len(_by(recs, "probe")) == 2 * 2 * model.n_layers  # labels x aggregators x layers
    assert set(s["labels"]) == {"truth", "model"}
