"""The pair instruments against the engine's own reads and hand arithmetic, on a tiny random llama
over the real llama vocabulary: shapes, identities, the margin gate, the exact check, controls."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

import kvnotes as kv
from kvnotes.edit.attribution import attribute_cache
from kvnotes.edit.patching import patched_scores
from kvnotes.pairs import instruments

CLEAN = ("Visitor log: Priya arrived at nine. Her badge is red.\nPolicy: if the badge is red, reply Alpha; "
         "otherwise reply Beta.\nExample: green badge -> Beta.\nExample: red badge -> Alpha.\nWhich wing? Answer:")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread."""


@pytest.fixture(scope="module")
def model(tiny_llama_vocab):
    return tiny_llama_vocab.with_margin(0.0)


@pytest.fixture(scope="module")
def pp(model):
    pair = kv.Pair.from_prompts(model, CLEAN, CLEAN.replace("badge is red.", "badge is blue.", 1),
                                answers=(" Alpha", " Beta"), spans={"rule": "if the badge is red, reply Alpha"})
    return kv.prepare(model, pair)


def test_patch_map_by_position_is_the_engine_read_and_zero_before_the_field(model, pp):
    df = kv.patch_map(model, pp)
    assert list(df.position) == list(range(pp.n_cached))
    s, _ = pp.item.field_span
    assert (df.effect[:s] == 0).all() and set(df.segment[:s]) == {"before"}
    want = patched_scores(model, pp, [[p] for p in pp.field_to_end])
    assert np.allclose(df.score[s:], want)
    assert np.allclose(df.recovery, df.effect / pp.delta)
    assert {"token", "segment", "score", "effect", "recovery"} <= set(df.columns)
    assert "rule" in set(df.segment) and df.attrs["usable"]


def test_patch_map_over_layers_cells_and_heads(model, pp):
    lay = kv.patch_map(model, pp, over="layer")
    assert list(lay.layer) == list(range(model.n_layers))
    cells = kv.patch_map(model, pp, over="position_layer")
    assert len(cells) == len(pp.field_to_end) * model.n_layers
    heads = kv.patch_map(model, pp, over="head")
    assert len(heads) == model.n_layers * model.adapter.n_heads(model.hf)
    from probes.parts.heads import single_effects  # the probe's read-head effects: the same numbers
    assert np.allclose(heads.recovery, single_effects(model, pp), equal_nan=True)
    with pytest.raises(ValueError, match="valid: position"):
        kv.patch_map(model, pp, over="token")


def test_recoveries_span_the_standard_patches_and_named_spans(model, pp):
    df = kv.recoveries(model, pp, spans={"last_two": [-2, -1]}).set_index("condition")
    assert df.loc["corrupt", "recovery"] == pytest.approx(0.0, abs=1e-3)
    assert df.loc["clean", "recovery"] == pytest.approx(1.0, abs=1e-3)
    assert df.loc["full_downstream", "recovery"] == pytest.approx(1.0, abs=1e-3)
    assert {"rule", "last_two"} <= set(df.index) and df.loc["last_two", "n_positions"] == 2


def test_below_the_margin_a_warning_and_nan_recoveries_never_a_ratio_of_noise(model, pp):
    with pytest.warns(kv.UnusablePairWarning, match="recoveries are reported as NaN"):
        df = kv.patch_map(model, pp, margin=abs(pp.delta) * 2)
    assert df.recovery.isna().all() and np.isfinite(df.effect).all() and not df.attrs["usable"]
    with pytest.warns(kv.UnusablePairWarning):
        rec = kv.recoveries(model, pp, margin=1e9)
    assert rec.recovery.isna().all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kv.recoveries(model, pp, margin=0.0)  # at or above the margin: silent


def test_attribution_map_is_the_engine_estimate_checked_against_exact(model, pp):
    df = kv.attribution_map(model, pp, check_top=4)
    want = attribute_cache(model, pp).per_position("qk")
    assert np.allclose(df.estimate, want)
    exact = kv.patch_map(model, pp)
    assert np.allclose(df.exact, exact.effect)
    assert -1 <= df.attrs["spearman"] <= 1 and 0 <= df.attrs["top_overlap"] <= 1
    cells = kv.attribution_map(model, pp, over="position_layer", check_top=5)
    checked = cells[cells.exact.notna()]
    assert len(checked) == 5 and checked.estimate.min() >= cells.estimate[cells.exact.isna()].max()


def test_knockout_hides_the_chosen_keys_beside_matched_random_ones(model, pp):
    df = kv.knockout(model, pp, n_random=4, seed=1)
    chosen, rand = df[df.condition == "chosen"].iloc[0], df[df.condition == "random_matched"]
    assert len(rand) == 4 and (rand.n_keys == chosen.n_keys).all()
    down = set(pp.downstream_positions)
    assert all(set(k) <= down and not set(k) & set(chosen["keys"]) for k in rand["keys"])
    assert np.allclose(df.reversion, (pp.score_oracle - df.score) / (pp.score_oracle - pp.score_stale))
    assert 1 / 5 <= df.attrs["p_random"] <= 1
    again = kv.knockout(model, pp, n_random=4, seed=1)
    assert again["keys"].tolist() == df["keys"].tolist()
    one = kv.knockout(model, pp, positions=[pp.downstream_positions[0]], layers=[1], heads=[0], n_random=2)
    assert one["n_keys"].tolist() == [1, 1, 1]


def test_localize_ranks_each_pair_on_the_others(model):
    tok = model.tokenizer
    pairs = [kv.Pair.from_prompts(tok, CLEAN.replace("Priya", name), CLEAN.replace("Priya", name)
                                  .replace("badge is red.", "badge is blue.", 1), answers=(" Alpha", " Beta"),
                                  pair_id=name) for name in ("Priya", "Tom", "Ana")]
    df = kv.localize(model, pairs, threshold=0.5, k_scan=4)
    assert set(df.pair_id) == {"Priya", "Tom", "Ana"} and set(df.attrs["k_threshold"]) == set(df.pair_id)
    k = df.attrs["k_threshold"]["Tom"]
    assert math.isnan(k) or df[(df.pair_id == "Tom") & (df.k == k)].recovery.iloc[0] >= 0.5
    with pytest.raises(ValueError, match="at least two"):
        kv.localize(model, pairs[:1])


def test_linear_probe_accuracy_per_layer_with_wilson_intervals(model):
    prompts = [f"Item {i}: the colour is {'red' if i % 2 else 'blue'}" for i in range(12)]
    df = kv.linear_probe(model, prompts, [i % 2 for i in range(12)], n_splits=3)
    assert list(df.layer) == list(range(model.n_layers))
    assert ((df.ci_lo <= df.accuracy) & (df.accuracy <= df.ci_hi)).all()
    assert df.accuracy.max() == 1.0  # the last token names the class: separable
    with pytest.raises(ValueError, match="two label classes"):
        kv.linear_probe(model, prompts, [0] * 12)


def test_segment_names_mark_before_field_spans_and_the_decision(pp):
    seg = instruments.segment_names(pp.item)
    s, e = pp.item.field_span
    assert seg[:s] == ["before"] * s and seg[s:e] == ["field"] * (e - s) and seg[-1] == "decision"
