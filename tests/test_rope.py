"""A block prefilled alone and rotated by delta equals the block prefilled at positions delta.."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import ATOL_FP32

from kvnotes import rope, run
from kvnotes.cache import KVCache
from kvnotes.models.tiny import tiny_model


def _prefill_at(model, ids, start):
    """Reference: the block run alone with explicit position ids start.. (HF forward)."""
    from transformers import DynamicCache

    pos = torch.arange(start, start + ids.shape[1])[None]
    out = model.hf(input_ids=ids, position_ids=pos, past_key_values=DynamicCache(), use_cache=True)
    return KVCache.from_dynamic(out.past_key_values)


def _check(model, n, delta, seed=0):
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))
    alone = run.prefill(model, ids).cache
    moved = rope.reposition(model, alone, delta)
    ref = _prefill_at(model, ids, delta)
    dk = max((a - b).abs().max().item() for a, b in zip(moved.keys, ref.keys))
    assert dk <= ATOL_FP32, f"key diff {dk}"
    assert all(torch.equal(a, b) for a, b in zip(moved.values, alone.values))


def test_rotation_matches_prefill_at_offset(tiny):
    _check(tiny, 20, 37)


def test_rotations_compose(tiny):
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    c = run.prefill(tiny, ids).cache
    two = rope.reposition(tiny, rope.reposition(tiny, c, 11), 30)
    one = rope.reposition(tiny, c, 41)
    back = rope.reposition(tiny, one, -41)
    assert two.max_abs_diff(one) <= ATOL_FP32
    assert back.max_abs_diff(c) <= ATOL_FP32


_MODELS = {f: tiny_model(f) for f in ("llama", "qwen3", "gemma3")}


@settings(max_examples=12, deadline=None)
@given(
    family=st.sampled_from(sorted(_MODELS)),
    n=st.integers(1, 30),
    delta=st.integers(0, 200),
    seed=st.integers(0, 10_000),
)
def test_rotation_property(family, n, delta, seed):
    """llama3 scaling, YaRN attention_scaling and gemma3's per-layer bases, random shapes."""
    _check(_MODELS[family], n, delta, seed)


def test_yarn_scaling_is_divided_out():
    m = _MODELS["qwen3"]
    assert m.adapter._attention_scaling(m.hf, 0) != 1.0  # the config really exercises it
    cos, sin = m.adapter.rope_cos_sin(m.hf, torch.tensor([5]), 0)
    assert torch.allclose(cos**2 + sin**2, torch.ones_like(cos), atol=1e-6)
