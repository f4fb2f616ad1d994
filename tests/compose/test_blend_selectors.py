"""The attribution and query-aware repair selectors of kvnotes.compose.blend on tiny models:
constructed caches where the expected tokens are known (a deviation placed at chosen positions of
the check layer; keys at chosen positions aligned with the question's layer-0 queries), the
query's attention against transformers' own eager attention weights, and every ranked rule
recomputing exactly its budget of block tokens at 5/10/15/20 %."""

from __future__ import annotations

import pytest
import torch
from hf_reference import _cache
from test_blend_selection import random_layout

from kvnotes.compose import blend
from kvnotes.compose import splice as compose
from kvnotes.compose.blend import Method
from kvnotes.engine import run
from kvnotes.engine.cache import KVCache
from kvnotes.engine.gradients import cache_gradients
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


def answer_logprob(model, cache: KVCache, tail, token: int) -> float:
    logits = run.extend(model, cache, list(tail)).logits[0, -1]
    return float(torch.log_softmax(logits, -1)[token])


def test_attribution_picks_the_positions_whose_check_layer_kv_deviate_and_estimates_their_effect(tiny):
    """A clean prefill of the context deviates from itself nowhere; bumping K/V at the check layer
    at three block positions makes exactly those the attribution's top three, and each score is
    the first-order change of the answer's log-prob when that position is restored."""
    lay = random_layout(4)
    layer = 1
    clean = run.prefill(tiny, lay.context).cache
    g = torch.Generator().manual_seed(5)
    keys, values = [k.clone() for k in clean.keys], [v.clone() for v in clean.values]
    bumped = [6, 14, 22]
    for p in bumped:  # block positions (head 0..3)
        keys[layer][0, :, p] += 0.05 * torch.randn(keys[layer][0, :, p].shape, generator=g)
        values[layer][0, :, p] += 0.05 * torch.randn(values[layer][0, :, p].shape, generator=g)
    reused = KVCache(tuple(keys), tuple(values))
    score = blend.answer_attribution(tiny, reused, lay, layer)
    assert score.shape == (len(lay.context),)
    assert score[[p for p in range(len(lay.context)) if p not in bumped]].max() < 1e-4 * score[bumped].max()
    assert blend.cacheblend_positions(score, lay, 3 / lay.n_block_tokens) == bumped
    top = int(run.extend(tiny, reused, list(lay.tail)).logits[0, -1].argmax())
    base = answer_logprob(tiny, reused, lay.tail, top)
    for p in bumped:  # restore p at the check layer (and push it as far the other way): central difference
        moved = []
        for sign in (1.0, -1.0):
            k2, v2 = list(keys), list(values)
            k2[layer], v2[layer] = keys[layer].clone(), values[layer].clone()
            for new, old, ref in ((k2[layer], keys[layer], clean.keys[layer]), (v2[layer], values[layer], clean.values[layer])):
                new[0, :, p] = old[0, :, p] + sign * (ref[0, :, p] - old[0, :, p])
            moved.append(answer_logprob(tiny, KVCache(tuple(k2), tuple(v2)), lay.tail, top) - base)
        assert float(score[p]) == pytest.approx(abs(moved[0] - moved[1]) / 2, rel=0.05, abs=2e-6)
    with pytest.raises(ValueError, match="check layer"):
        blend.answer_attribution(tiny, reused, lay, tiny.n_layers)


def test_query_aware_is_the_questions_attention_summed(tiny):
    """Against transformers' eager attention weights of the tail over the same cache."""
    lay = random_layout(5)
    head = run.prefill(tiny, list(lay.head)).cache
    naive = compose.transplant(tiny, head, [compose.prefill_block(tiny, list(b)) for b in lay.blocks], 0)
    got = blend.query_attention(tiny, naive, lay)
    cfg = tiny.hf.config
    saved = cfg._attn_implementation
    cfg._attn_implementation = "eager"  # the reference: transformers' own weights
    try:
        n = naive.seq_len
        out = tiny.hf(input_ids=torch.tensor([list(lay.tail)]), use_cache=True, output_attentions=True,
                      past_key_values=_cache(list(zip(naive.keys, naive.values))),
                      position_ids=torch.arange(n, n + len(lay.tail))[None])
    finally:
        cfg._attn_implementation = saved
    want = sum(a[0, :, :, :n].float().sum(dim=(0, 1)) for a in out.attentions)
    assert (got - want).abs().max().item() <= 1e-4
    assert got.sum().item() <= tiny.n_layers * tiny.adapter.n_heads(tiny.hf) * len(lay.tail) + 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_query_aware_picks_keys_aligned_with_the_questions_queries(family):
    """Layer 0's queries of the question do not depend on the cache: keys there set along them at
    two block positions draw nearly all of layer 0's attention, so those two are picked."""
    model = tiny_model(family, seed=1)
    lay = random_layout(6, sizes=(8, 8, 8))
    cache = run.prefill(model, lay.context).cache
    q = cache_gradients(model, cache, list(lay.tail), lambda lg: lg[-1, 0]).queries[0]  # [H, T, d] scaled
    kv = cache.keys[0].shape[1]
    target = q.reshape(kv, -1, q.shape[-1]).mean(1)  # [KV, d] mean query of each kv head's group
    keys = [k.clone() for k in cache.keys]
    chosen = [9, 25]
    for p in chosen:
        keys[0][0, :, p] = 60.0 * target / target.pow(2).sum(-1, keepdim=True)  # q . k ~ 60
    aligned = KVCache(tuple(keys), cache.values)
    score = blend.query_attention(model, aligned, lay)
    assert blend.cacheblend_positions(score, lay, 2 / lay.n_block_tokens) == chosen


@pytest.mark.parametrize("family", ["attribution", "query_aware", "cacheblend"])
@pytest.mark.parametrize("fraction", [0.05, 0.10, 0.15, 0.20])
def test_ranked_rules_recompute_exactly_their_budget_of_block_tokens(tiny, family, fraction):
    lay = random_layout(7, sizes=(20, 15, 25))
    head = run.prefill(tiny, list(lay.head)).cache
    blocks = [compose.prefill_block(tiny, list(b)) for b in lay.blocks]
    m = Method(family, fraction)
    built = blend.build(tiny, lay, head, blocks, m)
    k = blend.budget(lay.n_block_tokens, fraction)
    assert built.recomputed == k and abs(k / lay.n_block_tokens - fraction) <= 0.5 / lay.n_block_tokens
    assert built.checked == (0 if family == "query_aware" else len(lay.context))
    naive = compose.transplant(tiny, head, blocks, 0)
    changed = [p for p in range(len(lay.context))
               if any((a[0, :, p] - b[0, :, p]).abs().max() > 0 for a, b in zip(built.cache.keys, naive.keys))]
    assert len(changed) <= k and all(p >= len(lay.head) for p in changed)  # block tokens only
    assert m.name == f"{family}@{round(fraction * 100)}%"


def test_methods_refuse_a_missing_fraction():
    for family in ("attribution", "query_aware"):
        with pytest.raises(ValueError, match="fraction"):
            Method(family, 0.0)
    with pytest.raises(ValueError, match="valid: .*attribution, query_aware"):
        Method("prophet", 0.1)
