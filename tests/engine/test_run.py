"""prefill + extend must be the full forward; the caller's cache must never change."""

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes.engine import run, variants


def _ids(n: int, vocab: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("split", [1, 17, 39, 59])  # p < q, p >= q, one token past the window
def test_prefill_then_extend_equals_full_forward(tiny, split):
    ids = _ids(60)  # longer than the tiny sliding window (24)
    full = run.full_logits(tiny, ids)
    a = run.prefill(tiny, ids[:, :split], logits_to_keep=0)
    b = run.extend(tiny, a.cache, ids[:, split:], logits_to_keep=0)
    got = torch.cat([a.logits, b.logits], dim=1)
    assert (got - full).abs().max().item() <= ATOL_FP32


def test_extend_does_not_mutate_input_cache(tiny):
    ids = _ids(20)
    c = run.prefill(tiny, ids[:, :10]).cache
    before = c.clone()
    run.extend(tiny, c, ids[:, 10:])
    assert c.seq_len == 10 and c.max_abs_diff(before) == 0.0


def test_extend_many_matches_one_by_one(tiny):
    ids = _ids(30)
    caches = [run.prefill(tiny, _ids(20, seed=s)).cache for s in range(5)]
    batched = run.extend_many(tiny, caches, ids[:, 20:23], batch_size=2)
    single = torch.cat([run.extend(tiny, c, ids[:, 20:23]).logits for c in caches])
    assert (batched - single).abs().max().item() <= ATOL_FP32


def test_bad_ids_are_refused(tiny):
    with pytest.raises(ValueError, match="non-empty"):
        run.prefill(tiny, torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.real
def test_real_llama_prefill_extend_equals_full(llama):
    ids = llama.tokenizer("The capital of France is Paris. The capital of Spain is", return_tensors="pt").input_ids
    full = run.full_logits(llama, ids)
    n = ids.shape[1] // 2
    a = run.prefill(llama, ids[:, :n], logits_to_keep=0)
    b = run.extend(llama, a.cache, ids[:, n:], logits_to_keep=0)
    assert (torch.cat([a.logits, b.logits], 1) - full).abs().max().item() <= ATOL_FP32


def test_read_variants_equals_materialised_patches(tiny):
    """The batched variant attention is exact: same logits as building each patched cache."""
    from kvnotes.engine.cache import patch

    g = torch.Generator().manual_seed(0)
    a = run.prefill(tiny, torch.randint(0, 128, (1, 40), generator=g)).cache
    b = run.prefill(tiny, torch.randint(0, 128, (1, 40), generator=g)).cache
    tail = torch.randint(0, 128, (1, 3), generator=g)
    positions = [[0], [5], [39], [3, 7, 3], [], list(range(10, 40))]
    layers = [None, None, [1], [0, 2], None, [1, 3]]
    got = variants.read_variants(tiny, a, b, positions, tail, layers, batch_size=4)
    want = torch.cat(
        [run.extend(tiny, patch(a, b, p, lay), tail, logits_to_keep=0).logits for p, lay in zip(positions, layers)]
    )
    assert (got - want).abs().max().item() <= ATOL_FP32
    assert tiny.hf.config._attn_implementation == tiny.adapter.attn_implementation  # restored


def _eager(tiny):
    """Same weights, eager attention: the reference for masks and attention weights."""
    import copy

    ref = copy.deepcopy(tiny.hf)
    ref.config._attn_implementation = "eager"
    return ref


def test_knockout_all_layers_equals_a_4d_mask(tiny):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 20), generator=g)  # shorter than the sliding window (24)
    cache = run.prefill(tiny, ids[:, :-1]).cache  # a 4D mask overrides sliding masks
    masked = [2, 5, 12, 18]
    km = torch.zeros(1, 19, dtype=torch.bool)
    km[0, masked] = True
    got = variants.read_variants(tiny, cache, cache, [[]], ids[:, -1:], key_mask=km)[0, -1]
    allowed = torch.ones(20, 20).tril().bool()
    allowed[-1, masked] = False
    additive = torch.zeros(20, 20).masked_fill(~allowed, float("-inf"))  # a 4D mask is additive
    with torch.inference_mode():
        want = _eager(tiny)(input_ids=ids, attention_mask=additive[None, None]).logits[0, -1]
    assert (got - want).abs().max().item() <= ATOL_FP32


def test_knockout_respects_layers_and_heads_and_capture_matches_eager(tiny):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (1, 20), generator=g)
    cache = run.prefill(tiny, ids[:, :-1]).cache
    n_heads = tiny.adapter.n_heads(tiny.hf)
    km = torch.zeros(2, 19, dtype=torch.bool)
    km[:, 3] = True
    layers = torch.zeros(2, tiny.n_layers, dtype=torch.bool)
    layers[1, 1] = True
    heads = torch.zeros(2, n_heads, dtype=torch.bool)
    heads[1, 0] = True
    cap: list = []
    variants.read_variants(tiny, cache, cache, [[], []], ids[:, -1:], key_mask=km,
                      mask_layers=layers, mask_heads=heads, capture=cap)
    w = cap[0]  # {layer: [2, head, 1, 20]}
    assert w[1][1, 0, 0, 3] == 0 and w[1][1, 1, 0, 3] > 0  # only head 0 of layer 1 masked
    assert w[0][1, :, 0, 3].min() > 0  # nothing masked at layer 0
    assert w[0][0, :, 0, 3].min() > 0  # variant 0: no layers chosen, nothing masked
    with torch.inference_mode():
        ref = _eager(tiny)(input_ids=ids, output_attentions=True).attentions
    for layer in range(tiny.n_layers):
        assert (w[layer][0, :, 0] - ref[layer][0, :, -1]).abs().max().item() <= 1e-5


# --- engine speed: what the fast paths must not change ------------------------------------------


def test_text_is_tokenized_as_ids(tiny):
    """prefill/extend take text as TransformerLens' run_with_cache does (extend: no BOS)."""
    tok = tiny.tokenizer
    text, more = "The capital of France is", " Paris, and of Spain"
    a = run.prefill(tiny, text)
    assert torch.equal(a.logits, run.prefill(tiny, tok(text)["input_ids"]).logits)
    got = run.extend(tiny, a.cache, more).logits
    want = run.extend(tiny, a.cache, tok(more, add_special_tokens=False)["input_ids"]).logits
    assert torch.equal(got, want)


def test_text_without_a_tokenizer_is_refused(tiny):
    from kvnotes.models import wrap_model

    bare = wrap_model(tiny.hf)  # same module, no tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        run.prefill(bare, "hello")


def test_read_variants_refuses_out_of_range_positions_as_patch_does(tiny):
    from kvnotes.engine.cache import patch

    g = torch.Generator().manual_seed(0)
    c = run.prefill(tiny, torch.randint(0, 128, (1, 10), generator=g)).cache
    with pytest.raises(IndexError, match=r"position -11 out of range for a cache of 10 positions") as want:
        patch(c, c, [-11])
    with pytest.raises(IndexError) as got:
        variants.read_variants(tiny, c, c, [[2], [-11]], [5])
    assert str(got.value) == str(want.value)


def test_cached_extend_builds_no_mask_and_repeats_no_keys(tiny, monkeypatch):
    """Within the window, a causal extension reaches SDPA as is_causal (or one query), no mask,
    keys at their kv-head count: the fused kernel, not the full square with repeated keys."""
    import torch.nn.functional as F

    if tiny.hf.config._attn_implementation != "sdpa":
        pytest.skip("eager family (soft-capping): transformers builds its mask")
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        calls.append((attn_mask is None, kw.get("is_causal", False), k.shape[1], q.shape[2]))
        return real(q, k, v, attn_mask, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    ids = _ids(21)  # shorter than the tiny sliding window (24)
    c = run.prefill(tiny, ids[:, :8]).cache
    run.extend(tiny, c, ids[:, 8:20])  # 8 cached, 12 new: p < q
    run.extend(tiny, c, ids[:, 8:9])  # one token
    kv = tiny.adapter.n_kv_heads(tiny.hf)
    assert calls and all(no_mask and heads == kv for no_mask, _, heads, _ in calls)
    assert all(causal for _, causal, _, rows in calls if rows > kv)  # rows: packed single query


def test_forward_at_fuses_recompute_and_append(tiny):
    """Recomputing positions and appending tokens in one forward equals the two calls."""
    from kvnotes.engine.cache import buffers

    old, new = _ids(26, seed=0), _ids(26, seed=0).clone()
    new[0, 5:7] = torch.tensor([3, 4])
    c = run.prefill(tiny, old[:, :20]).cache
    fixed = run.recompute(tiny, c, new[:, :20], [5, 6])
    want = run.extend(tiny, fixed, new[:, 20:], logits_to_keep=0)
    keys, values = buffers(c, 2 + 6, 1, tiny.device)
    pos = [5, 6, *range(20, 26)]
    logits = run.forward_at(tiny, keys, values, 20, new[:, pos], pos, logits_to_keep=6)
    got = KVCache_of(keys, values, 26)
    assert logits is not None and (logits - want.logits).abs().max().item() <= ATOL_FP32
    assert got.max_abs_diff(want.cache) <= ATOL_FP32
    with pytest.raises(IndexError, match="appended"):
        run.forward_at(tiny, keys, values, 20, new[:, [21]], [21])


def KVCache_of(keys, values, n):
    from kvnotes.engine.cache import KVCache

    return KVCache(tuple(k[:, :, :n] for k in keys), tuple(v[:, :, :n] for v in values))


def test_variant_batch_size_follows_free_memory(tiny, monkeypatch):
    import kvnotes.measure.timing

    monkeypatch.setattr(kvnotes.measure.timing, "available_bytes", lambda device: 10**6)
    small = variants.variant_batch_size(tiny, 1000, 1, 1)
    monkeypatch.setattr(kvnotes.measure.timing, "available_bytes", lambda device: 10**10)
    large = variants.variant_batch_size(tiny, 1000, 1, 1)
    assert 1 <= small < large <= 1024
    g = torch.Generator().manual_seed(0)
    a = run.prefill(tiny, torch.randint(0, 128, (1, 12), generator=g)).cache
    b = run.prefill(tiny, torch.randint(0, 128, (1, 12), generator=g)).cache
    each = [[p] for p in range(12)]
    auto = variants.read_variants(tiny, a, b, each, [7])
    assert (auto - variants.read_variants(tiny, a, b, each, [7], batch_size=5)).abs().max() <= ATOL_FP32


def test_read_variants_restricted_vocab_equals_the_full_logits(tiny):
    g = torch.Generator().manual_seed(3)
    a = run.prefill(tiny, torch.randint(0, 128, (1, 15), generator=g)).cache
    b = run.prefill(tiny, torch.randint(0, 128, (1, 15), generator=g)).cache
    each, vocab = [[], [3], [1, 14]], [7, 100, 3]
    full = variants.read_variants(tiny, a, b, each, [9, 4])
    some = variants.read_variants(tiny, a, b, each, [9, 4], vocab=vocab)
    assert some.shape == (3, 2, 3) and (some - full[..., vocab]).abs().max().item() <= ATOL_FP32


def test_recompute_extend_is_recompute_then_extend_in_one_forward(tiny):
    old, new = _ids(30, seed=1), _ids(30, seed=1).clone()
    new[0, 4:6] = torch.tensor([9, 8])
    c = run.prefill(tiny, old[:, :25]).cache
    want = run.extend(tiny, run.recompute(tiny, c, new[:, :25], [4, 5, 11]), new[:, 25:], logits_to_keep=0)
    calls = []
    hook = tiny.adapter.decoder(tiny.hf).register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        got = run.recompute_extend(tiny, c, new[:, :25], [11, 4, 5], new[:, 25:], logits_to_keep=0)
    finally:
        hook.remove()
    assert len(calls) == 1 and got.cache.seq_len == 30
    assert (got.logits - want.logits).abs().max().item() <= ATOL_FP32
    assert got.cache.max_abs_diff(want.cache) <= ATOL_FP32


def test_extend_into_writes_in_place_and_equals_extend(tiny):
    from kvnotes.engine.cache import buffers

    ids = _ids(40)
    c = run.prefill(tiny, ids[:, :20]).cache
    keys, values = buffers(c, 20, 1, tiny.device)  # room for every later token
    ptr = keys[0].data_ptr()
    step = run.extend_into(tiny, keys, values, 20, ids[:, 20:25])
    ref = run.extend(tiny, c, ids[:, 20:25])
    assert torch.equal(step.logits, ref.logits) and step.cache.max_abs_diff(ref.cache) == 0.0
    assert step.cache.seq_len == 25 and step.cache.keys[0].data_ptr() == ptr  # a view: no copy
    for t in range(25, 40):  # a decode loop over one set of buffers is the full forward
        step = run.extend_into(tiny, keys, values, t, ids[:, t : t + 1], logits_to_keep=1)
    full = run.full_logits(tiny, ids)[:, -1]
    assert (step.logits[:, -1] - full).abs().max().item() <= ATOL_FP32
    with pytest.raises(ValueError, match="do not fit"):
        run.extend_into(tiny, keys, values, 39, ids[:, :2])
    with pytest.raises(ValueError, match="layers of buffers"):
        run.extend_into(tiny, keys[:1], values[:1], 20, ids[:, :1])


def test_a_forward_past_the_models_positions_is_one_config_error(tmp_path):
    """Issue #36: a prefill longer than max_position_embeddings ran without a word. A checkpoint
    loaded by load_model is bounded by its config; a cached + new length past it names both."""
    from kvnotes.errors import ConfigError
    from kvnotes.models import load_model
    from kvnotes.models.tiny import tiny_model

    m = tiny_model("llama")
    m.hf.config.max_position_embeddings = 16
    m.hf.save_pretrained(tmp_path)
    m.tokenizer.save_pretrained(tmp_path)
    model = load_model(str(tmp_path), device="cpu", check_logits=False)
    with pytest.raises(ConfigError, match=r"17 positions .* has 16 \(max_position_embeddings\)"):
        run.prefill(model, _ids(17))
    step = run.prefill(model, _ids(10))
    with pytest.raises(ConfigError, match=r"10 cached \+ 7 new = 17 positions"):
        run.extend(model, step.cache, _ids(7))
    assert run.extend(model, step.cache, _ids(6)).cache.seq_len == 16  # the limit itself runs
    with pytest.raises(ConfigError, match="17 positions"):
        run.recompute_extend(model, step.cache, _ids(10), [3], _ids(7))


def test_cuda_graphs_are_refused_in_one_line_off_cuda():
    from kvnotes.engine.cache import buffers
    from kvnotes.engine.graphs import GraphedExtend
    from kvnotes.errors import ConfigError
    from kvnotes.models.tiny import tiny_model

    m = tiny_model("llama")
    cache = run.prefill(m, torch.arange(5)[None]).cache
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device") as e:
        GraphedExtend(m, *buffers(cache, 1, 1, m.device), 5, 1)
    assert "\n" not in str(e.value)
