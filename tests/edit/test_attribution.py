"""Attribution patching over the cache (kvnotes.edit.attribution, kvnotes.engine.gradients) against
exact patching of the same entries (kvnotes.edit.patching, itself checked against plain HF forwards
in test_patching), on tiny random models of every family (GQA: 4 query heads on 2 KV heads;
mistral, gemma2 and gemma3 with a sliding window of 24 below the 39 cached positions).

A single entry (position, layer, KV head) is patched by building a pair whose new cache is the
old one with that entry changed: a tiny change must be estimated to first order (V and K), a
large key change at the last layer exactly by the QK fix once everything after that layer's
attention is linear (final norm removed, last MLP zeroed), and not by the linear estimate.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from test_patching import item

from kvnotes.edit.attribution import attribute_cache, to_recovery, top_positions
from kvnotes.edit.patching import PatchPair, make_pair, patched_scores, recoveries
from kvnotes.engine.cache import KVCache
from kvnotes.engine.gradients import cache_gradients
from kvnotes.models import FAMILIES
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


@pytest.fixture(scope="module", params=FAMILIES)
def tiny64(request):
    """Each family in float64: first-order checks need the rounding far below eps^2."""
    return tiny_model(request.param, seed=0, dtype=torch.float64)


def entry_pair(pair: PatchPair, layer: int, pos: int, head: int, dk=None, dv=None) -> PatchPair:
    """`pair` whose new cache is its old one with K (+dk) and V (+dv) changed at one entry."""
    keys, values = [k.clone() for k in pair.old.keys], [v.clone() for v in pair.old.values]
    if dk is not None:
        keys[layer][0, head, pos] += dk
    if dv is not None:
        values[layer][0, head, pos] += dv
    return dataclasses.replace(pair, new=KVCache(tuple(keys), tuple(values)))


def exact_effect(model, pair: PatchPair, layer: int, pos: int) -> float:
    return float(patched_scores(model, pair, [[pos]], [[layer]])[0] - pair.score_stale)


def test_gradient_forward_reads_the_stale_score(tiny):
    pair = make_pair(tiny, item())
    g = cache_gradients(tiny, pair.old, pair.tail, lambda logits: pair.item.decision_score(logits[-1]))
    assert g.score == pytest.approx(pair.score_stale, abs=1e-4)
    h, kv = tiny.adapter.n_heads(tiny.hf), tiny.adapter.n_kv_heads(tiny.hf)
    assert g.grad_keys[0].shape == (kv, pair.n_cached, tiny.adapter.head_dim(tiny.hf))
    assert g.probs[0].shape == (h, 1, pair.n_cached + 1)
    assert all(torch.allclose(p.sum(-1), torch.ones(h, 1)) for p in g.probs)


def test_map_shape_and_zero_before_the_field(tiny):
    it = item(span=(10, 13))
    pair = make_pair(tiny, it)
    a = attribute_cache(tiny, pair)
    assert a.shape == (pair.n_cached, tiny.n_layers, tiny.adapter.n_kv_heads(tiny.hf))
    for m in (a.key_linear, a.key_qk, a.value):
        assert np.all(m[:10] == 0.0)  # identical K/V in both runs: no effect, exactly
        assert np.isfinite(m).all()
    assert a.per_position().shape == (pair.n_cached,) and a.per_position_layer("linear").shape == a.shape[:2]
    with pytest.raises(ValueError, match="valid: qk, linear"):
        a.total("exact")


@pytest.mark.parametrize("part", ["value", "key"])
def test_small_change_of_one_entry_is_estimated_to_first_order(tiny64, part):
    """Central differences (+step, -step) of the estimate against those of the exact effects:
    second order cancels in both; the exact reads run their attention in fp32, hence the floor."""
    model = tiny64
    pair = make_pair(model, item())
    g = torch.Generator().manual_seed(1)
    d = model.adapter.head_dim(model.hf)
    biggest = 0.0
    for layer, pos, head in ((0, 30, 1), (model.n_layers - 1, 20, 0), (1, 37, 1)):
        step = (1e-2 if part == "value" else 2e-2) * torch.randn(d, generator=g, dtype=torch.float64)
        kind = "dv" if part == "value" else "dk"
        plus, minus = (entry_pair(pair, layer, pos, head, **{kind: s * step}) for s in (1.0, -1.0))
        central = (exact_effect(model, plus, layer, pos) - exact_effect(model, minus, layer, pos)) / 2
        biggest = max(biggest, abs(central))
        a, b = attribute_cache(model, plus), attribute_cache(model, minus)
        names = ["value"] if part == "value" else ["key_linear", "key_qk"]
        for est, neg in ((getattr(a, n), getattr(b, n)) for n in names):
            first = (est[pos, layer, head] - neg[pos, layer, head]) / 2  # the QK fix is not odd in the step
            assert first == pytest.approx(central, rel=1e-2, abs=3e-7)  # sign too
            others = est.copy()
            others[pos, layer, head] = 0.0
            assert np.all(others == 0.0)  # nothing else changed, nothing else estimated
        if part == "value":
            assert np.all(a.key_linear == 0.0) and np.all(a.key_qk == 0.0)
    assert biggest > 5e-6  # the checks are not all inside the floor


def test_sliding_window_hides_far_positions(tiny64):
    """Position 0 is 39 positions before the readout: outside a window of 24, so a sliding layer
    reads neither its key nor its value (exactly 0), while a full layer does."""
    model = tiny64
    window = [model.adapter.sliding_window(model.hf, i) for i in range(model.n_layers)]
    pair = make_pair(model, item())
    g = torch.Generator().manual_seed(2)
    d = model.adapter.head_dim(model.hf)
    for layer, w in enumerate(window):
        p = entry_pair(pair, layer, 0, 0, dk=torch.randn(d, generator=g, dtype=torch.float64),
                       dv=torch.randn(d, generator=g, dtype=torch.float64))
        a = attribute_cache(model, p)
        total = a.total()[0, layer, 0]
        exact = exact_effect(model, p, layer, 0)
        if w:  # the exact read's floor: its attention runs in fp32
            assert total == 0.0 and exact == pytest.approx(0.0, abs=1e-6)
        else:
            assert abs(total) > 1e-5 and abs(exact) > 1e-5


def linear_after_last_attention(family: str):
    """A tiny model whose score is linear in the last layer's attention pattern: no final norm,
    the last MLP's output zeroed, gemma's norm of the attention output removed (the residual after
    the last attention goes straight to the head)."""
    model = tiny_model(family, seed=3, dtype=torch.float64)
    dec = model.adapter.decoder(model.hf)
    dec.norm = torch.nn.Identity()
    last = model.adapter.layers(model.hf)[-1]
    with torch.no_grad():
        last.mlp.down_proj.weight.zero_()
    if hasattr(last, "post_feedforward_layernorm"):  # gemma: norms on the attention's and MLP's outputs
        last.post_feedforward_layernorm = torch.nn.Identity()
        last.post_attention_layernorm = torch.nn.Identity()
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_qk_fix_is_exact_where_only_the_readout_reads_the_key(family):
    """Cached keys are read by the last prompt token only; at the last layer with a linear rest, the
    pattern recomputed with the new key is the whole effect: QK-fixed = exact, linear is off."""
    model = linear_after_last_attention(family)
    pair = make_pair(model, item())
    layer = model.n_layers - 1
    g = torch.Generator().manual_seed(4)
    d = model.adapter.head_dim(model.hf)
    worst_linear = 0.0
    for pos, head in ((38, 0), (30, 1), (20, 0)):
        q = torch.randn(d, generator=g, dtype=torch.float64)
        p = entry_pair(pair, layer, pos, head, dk=8.0 * q / q.norm() * d**0.5)  # scores move by O(1..10)
        a = attribute_cache(model, p)
        exact = exact_effect(model, p, layer, pos)
        assert a.key_qk[pos, layer, head] == pytest.approx(exact, rel=1e-3, abs=1e-7)  # the fp32 floor
        worst_linear = max(worst_linear, abs(a.key_linear[pos, layer, head] - exact) / abs(exact))
    assert worst_linear > 0.05  # the plain linear estimate is visibly wrong through the softmax


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
def test_position_ranks_agree_with_the_exact_map(family):
    model = tiny_model(family, seed=0)
    rhos = []
    for seed in range(3):
        pair = make_pair(model, item(seed=seed))
        pos = pair.field_to_end
        exact = patched_scores(model, pair, [[p] for p in pos]) - pair.score_stale
        est = attribute_cache(model, pair).per_position()[pos]
        rhos.append(spearmanr(est, exact).statistic)
    assert np.mean(rhos) > 0.9


def test_recovery_uses_the_exact_maps_normalisation():
    model = tiny_model("llama", seed=0)
    pair = make_pair(model, item())
    eff = attribute_cache(model, pair).per_position()
    assert np.allclose(to_recovery(pair, eff), recoveries(pair, pair.score_stale + eff))
    assert np.allclose(to_recovery(pair, eff), eff / pair.delta)


def test_top_positions_best_first_among_candidates():
    v = np.array([0.5, 3.0, -1.0, 3.0, 2.0])
    assert top_positions(v, 2) == [1, 3]  # tie broken by position
    assert top_positions(v, 3, candidates=[0, 2, 4]) == [4, 0, 2]


def test_encode_decode_keeps_the_map_in_float16():
    from kvnotes.edit.attribution import decode, encode

    model = tiny_model("qwen2", seed=0)
    a = attribute_cache(model, make_pair(model, item()))
    b = decode(encode(a))
    assert b.shape == a.shape and b.score == a.score
    for name in ("key_linear", "key_qk", "value"):
        assert np.allclose(getattr(b, name), getattr(a, name), rtol=1e-3, atol=1e-7)
