"""A block prefilled alone and rotated by delta equals the block prefilled at positions delta.."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import longrope_model as _longrope_model
from tolerances import ATOL_FP32

from kvnotes.engine import rope, run
from kvnotes.engine.cache import KVCache
from kvnotes.models import rope_types
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


# --- rope variants a delta rotation cannot move exactly: refused, never silently wrong --------


def test_longrope_is_wrong_past_the_original_context_so_it_is_refused():
    """Why it is refused: HF's own keys at positions past 64 use the long factors, so the key a
    rotation by delta would produce (short factors) is far off; every kvnotes rotation refuses."""
    import pytest

    m = _longrope_model()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    at = _prefill_at(m, ids, 100)  # HF: positions 100..107 > 64, long factors
    alone = run.prefill(m, ids).cache  # positions 0..7: short factors
    rot = m.hf.model.rotary_emb  # its own cos/sin at delta=100 (long factors there)
    cos, sin = rot(torch.zeros(1), torch.tensor([[100]]))
    k = alone.keys[0].float()  # layer 0: keys carry no context, only the rotation differs
    naive = k * cos[0] + rope.rotate_half(k) * sin[0]
    rel = ((naive - at.keys[0]).abs().max() / at.keys[0].abs().max()).item()
    assert rel > 0.1, rel  # the silent error the refusal prevents
    with pytest.raises(rope_types.UnsupportedRopeError, match="longrope"):
        rope.reposition(m, alone, 100)
    with pytest.raises(rope_types.UnsupportedRopeError, match="longrope"):
        m.adapter.rope_cos_sin(m.hf, torch.tensor([3]), 0)
    facts = rope.rope_facts(m)
    assert not facts[0]["supported"] and "longrope" in facts[0]["unsupported_reason"]


def test_unknown_and_partial_rope_are_refused_and_static_ones_pass():
    import pytest

    for t in rope_types.STATIC_ROPE_TYPES:
        rope_types.check_rope_type(t)
    with pytest.raises(rope_types.UnsupportedRopeError, match="dynamic"):
        rope_types.check_rope_type("dynamic", 3)
    with pytest.raises(rope_types.UnsupportedRopeError, match="proportional"):
        rope_types.check_rope_type("proportional")
    with pytest.raises(rope_types.UnsupportedRopeError, match="partial"):
        rope_types.check_rope_type("default", partial_rotary_factor=0.5)


def test_rope_facts_of_every_tiny_family(tiny):
    facts = rope.rope_facts(tiny)
    assert len(facts) == tiny.n_layers and all(f["supported"] for f in facts)
    windows = {f["sliding_window"] for f in facts}
    if tiny.adapter.family in ("mistral", "gemma2", "gemma3"):
        assert 24 in windows
    else:
        assert windows == {None}
