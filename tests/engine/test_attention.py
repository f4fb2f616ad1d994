"""kvnotes.engine.attention, called directly, against attention written out per variant; and the attention
of a partial recompute (`run.recompute`) against the HF model run one token at a time.

The variant attention never builds a patched cache: it writes the patched score columns in place
and adds the value change of patched slots after the softmax. The reference here does the slow
thing per variant: copy the base K/V, overwrite the patched slots with the source's, append the
tail's own K/V, repeat kv heads, mask (causal tail, sliding window by position, knockout), softmax.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import forward, prefill_kv
from tolerances import ATOL_FP32
from torch import nn

from kvnotes.engine import attention, run
from kvnotes.engine.cache import KVCache

B, H, KV, T, D, N, L = 4, 4, 2, 3, 8, 12, 3  # variants, heads, kv heads, tail, d_head, cached, layers
LAYER = 1
POSITIONS = [[2, 5, -1], [5, 5, 7], [-1, -1, -1], [0, 11, 3]]  # -1 pads; 5 listed twice
PATCHED = [[LAYER], [0, LAYER], [LAYER], [0, 2]]  # variant 3 patches other layers only


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


class _Layer(nn.Module):
    """What the attention reads from its module: the layer index."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx


def _cache(g: torch.Generator) -> KVCache:
    return KVCache(tuple(torch.randn(1, KV, N, D, generator=g) for _ in range(L)),
                   tuple(torch.randn(1, KV, N, D, generator=g) for _ in range(L)))


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    base, src = _cache(g), _cache(g)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, D, generator=g)
    layers = torch.zeros(B, L, dtype=torch.bool)
    for b, chosen in enumerate(PATCHED):
        layers[b, chosen] = True
    return base, src, q, k, v, torch.tensor(POSITIONS), layers


def _reference(base, src, q, k, v, positions, layers, scale, softcap=None, window=None,
               key_mask=None, mask_layers=None, mask_heads=None):
    """Attention of each variant written out: ([B, T, H, D] output, [B, H, T, N + T] weights)."""
    outs, weights = [], []
    g = H // KV
    for b in range(B):
        kb, vb = base.keys[LAYER][0].clone(), base.values[LAYER][0].clone()  # [KV, N, D]
        if layers[b, LAYER]:
            for p in positions[b].tolist():
                if p >= 0:
                    kb[:, p], vb[:, p] = src.keys[LAYER][0][:, p], src.values[LAYER][0][:, p]
        keys = torch.cat([kb, k[b]], 1).repeat_interleave(g, 0)  # [H, N + T, D]
        values = torch.cat([vb, v[b]], 1).repeat_interleave(g, 0)
        s = q[b] @ keys.transpose(1, 2) * scale  # [H, T, N + T]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        q_pos = N + torch.arange(T)[:, None]  # [T, 1]
        k_pos = torch.arange(N + T)[None, :]  # [1, N + T]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= (q_pos - k_pos) < window
        allowed = allowed[None].expand(H, T, N + T).clone()  # [H, T, N + T]
        if key_mask is not None and (mask_layers is None or mask_layers[b, LAYER]):
            for h in range(H):
                if mask_heads is None or mask_heads[b, h]:
                    allowed[h, :, :N] &= ~key_mask[b][None, :]
        w = s.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append((w @ values).transpose(0, 1))  # [T, H, D]
        weights.append(w)
    return torch.stack(outs), torch.stack(weights)


@pytest.mark.parametrize(("softcap", "window", "scaling"), [
    (None, None, None),  # plain: D ** -0.5
    (2.0, None, 0.3),  # soft-capping (gemma2) bites at this scale
    (None, 5, None),  # the window hides most of the cache from the tail
    (3.0, 2, 0.5),  # a window shorter than the tail hides earlier tail tokens too
])
def test_variants_equal_attention_over_each_patched_cache(softcap, window, scaling):
    base, src, q, k, v, positions, layers = _inputs()
    var = attention.Variants(base, src, positions, layers)
    got, none = attention._patched_attention(_Layer(LAYER), q, k, v, None, scaling=scaling,
                                             softcap=softcap, sliding_window=window, kvnotes_variants=var)
    scale = D**-0.5 if scaling is None else scaling
    want, _ = _reference(base, src, q, k, v, positions, layers, scale, softcap, window)
    assert none is None and got.shape == (B, T, H, D) and got.dtype == q.dtype
    assert (got - want).abs().max().item() <= 1e-5
    # the variants really differ: an unpatched reference is off for every patching variant
    plain, _ = _reference(base, src, q, k, v, positions, torch.zeros_like(layers), scale, softcap, window)
    differs = (got - plain).flatten(1).abs().amax(1)  # [B]
    if window is None:  # (with a window, the patched slots can all lie outside it)
        assert differs[:2].min() > 1e-3
    assert differs[2:].max() <= 1e-5  # variant 2 pads only, variant 3 patches other layers


def test_knockout_hides_keys_at_chosen_layers_and_heads_and_capture_is_the_softmax():
    base, src, q, k, v, positions, layers = _inputs(1)
    g = torch.Generator().manual_seed(5)
    key_mask = torch.rand(B, N, generator=g) < 0.4
    mask_layers = torch.tensor([[True] * L, [True] * L, [False] * L, [True] * L])  # variant 2: off
    mask_heads = torch.tensor([[True] * H, [True, False, False, True], [True] * H, [False] * H])
    cap: dict[int, torch.Tensor] = {}
    var = attention.Variants(base, src, positions, layers, key_mask, mask_layers, mask_heads, cap)
    got, _ = attention._patched_attention(_Layer(LAYER), q, k, v, None, softcap=4.0, sliding_window=7,
                                          kvnotes_variants=var)
    want, w = _reference(base, src, q, k, v, positions, layers, D**-0.5, 4.0, 7,
                         key_mask, mask_layers, mask_heads)
    assert (got - want).abs().max().item() <= 1e-5
    assert set(cap) == {LAYER} and cap[LAYER].shape == (B, H, T, N + T)
    assert (cap[LAYER] - w).abs().max().item() <= 1e-6
    assert torch.allclose(cap[LAYER].sum(-1), torch.ones(B, H, T))
    hidden = cap[LAYER][1, 0, :, :N][:, key_mask[1]]  # variant 1, head 0: masked keys weigh 0
    assert key_mask[1].any() and (hidden == 0).all()
    assert (cap[LAYER][1, 1, -1, :N][key_mask[1]] > 0).any()  # head 1 is not masked
    # masking other heads or layers only: the same output as no knockout for those heads
    none, _ = _reference(base, src, q, k, v, positions, layers, D**-0.5, 4.0, 7)
    assert (got[2] - none[2]).abs().max().item() <= 1e-5  # variant 2: mask layers off
    assert (got[3] - none[3]).abs().max().item() <= 1e-5  # variant 3: no head masked
    assert (got[1, :, 0] - none[1, :, 0]).abs().max().item() > 1e-4  # variant 1, head 0 changed


def test_variant_attention_needs_its_variants():
    base, src, q, k, v, positions, layers = _inputs()
    with pytest.raises(RuntimeError, match="read_variants"):
        attention._patched_attention(_Layer(LAYER), q, k, v, None)


def test_first_occurrence_keeps_the_first_of_repeated_positions():
    idx = torch.tensor([[5, 5, 7, 5], [-1, -1, 2, 3], [0, 1, 2, 3]])
    assert attention._first_occurrence(idx).tolist() == [
        [True, False, True, False], [True, False, True, True], [True, True, True, True]]


def test_register_is_idempotent_and_names_the_function():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    assert attention.register() == attention.register() == attention.NAME
    assert AttentionInterface()[attention.NAME] is attention._patched_attention
    assert AttentionMaskInterface()[attention.NAME] is sdpa_mask


# --- the attention of a partial recompute --------------------------------------------------------


def _sequential_recompute(model, old: list[int], new: list[int], chosen: list[int]):
    """The old prompt's K/V (HF prefill) with each chosen position, in order, run alone by the HF
    model at its position after the cache as it stands then (earlier chosen ones already
    recomputed, the others stale), its K/V written into its slot: per layer [1, kv, n, d]."""
    kv = [(k.clone(), v.clone()) for k, v in prefill_kv(model, old)]
    for p in chosen:
        _, out = forward(model, [(k[:, :, :p], v[:, :, :p]) for k, v in kv], [new[p]], p)
        for (k, v), (k_new, v_new) in zip(kv, out):
            k[:, :, p], v[:, :, p] = k_new[:, :, p], v_new[:, :, p]
    return kv


def test_partial_recompute_equals_recomputing_one_token_at_a_time(tiny):
    g = torch.Generator().manual_seed(4)
    old = torch.randint(7, 128, (32,), generator=g).tolist()  # beyond the tiny window (24)
    new = list(old)
    new[5:7] = [3, 4]  # the edited field
    chosen = [5, 6, 12, 27, 30]  # the field, a stale-neighbour note, two inside the window only
    stale = run.prefill(tiny, old).cache
    got = run.recompute(tiny, stale, new, [27, 5, 30, 12, 6, 5])  # any order, repeats
    want = _sequential_recompute(tiny, old, new, chosen)
    rest = [p for p in range(32) if p not in chosen]
    for layer, (k, v) in enumerate(want):
        assert (got.keys[layer] - k).abs().max().item() <= ATOL_FP32
        assert (got.values[layer] - v).abs().max().item() <= ATOL_FP32
        assert torch.equal(got.keys[layer][:, :, rest], stale.keys[layer][:, :, rest])
    # recomputed positions changed; position 12 read the stale 7..11, so it is no re-prefill
    fresh = run.prefill(tiny, new).cache
    last = tiny.n_layers - 1
    assert (got.keys[last][:, :, chosen] - stale.keys[last][:, :, chosen]).abs().max() > 1e-3
    assert (got.keys[last][:, :, 12] - fresh.keys[last][:, :, 12]).abs().max() > 1e-3


def test_recomputing_everything_from_the_field_on_is_a_re_prefill(tiny):
    g = torch.Generator().manual_seed(6)
    old = torch.randint(7, 128, (30,), generator=g).tolist()
    new = list(old)
    new[8] = 100
    got = run.recompute(tiny, run.prefill(tiny, old).cache, new, range(8, 30))
    assert got.max_abs_diff(run.prefill(tiny, new).cache) <= ATOL_FP32


def test_recompute_refusals(tiny):
    c = run.prefill(tiny, list(range(7, 17))).cache
    assert run.recompute(tiny, c, list(range(7, 17)), []) is c
    with pytest.raises(IndexError, match=r"0\.\.9"):
        run.recompute(tiny, c, list(range(7, 17)), [10])
    with pytest.raises(IndexError, match=r"ids \(5 tokens\) must cover the 10 cached positions"):
        run.recompute(tiny, c, list(range(7, 12)), [3])
    with pytest.raises(ValueError, match="batch-1"):
        run.recompute(tiny, _batch2(c), list(range(7, 17)), [3])


def _batch2(c: KVCache) -> KVCache:
    return KVCache(tuple(k.expand(2, -1, -1, -1) for k in c.keys),  # [2, kv_head, pos, d_head]
                   tuple(v.expand(2, -1, -1, -1) for v in c.values))
