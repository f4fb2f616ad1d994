"""KVCache value semantics and patching."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnotes.engine import run
from kvnotes.engine.cache import KVCache, cat, patch, stack


def _rand_cache(layers: int, pos: int, seed: int, batch: int = 1) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    ks = tuple(torch.randn(batch, 2, pos, 8, generator=g) for _ in range(layers))
    vs = tuple(torch.randn(batch, 2, pos, 8, generator=g) for _ in range(layers))
    return KVCache(ks, vs)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 5),
    pos=st.integers(1, 40),
    data=st.data(),
)
def test_patch_properties(layers, pos, data):
    a, b = _rand_cache(layers, pos, 0), _rand_cache(layers, pos, 1)
    positions = data.draw(st.lists(st.integers(0, pos - 1), unique=True, max_size=pos))
    chosen = data.draw(st.lists(st.integers(0, layers - 1), unique=True, min_size=1))
    out = patch(a, b, positions, chosen)
    for i in range(layers):
        for t_out, t_a, t_b in ((out.keys[i], a.keys[i], b.keys[i]), (out.values[i], a.values[i], b.values[i])):
            for p in range(pos):
                want = t_b if (i in chosen and p in positions) else t_a
                assert torch.equal(t_out[:, :, p], want[:, :, p])
    # inputs untouched
    assert a.max_abs_diff(_rand_cache(layers, pos, 0)) == 0.0


def test_patch_everything_gives_source_exactly(tiny):
    g = torch.Generator().manual_seed(3)
    a = run.prefill(tiny, torch.randint(0, 128, (1, 30), generator=g)).cache
    b = run.prefill(tiny, torch.randint(0, 128, (1, 30), generator=g)).cache
    assert patch(a, b, list(range(30))).max_abs_diff(b) == 0.0
    assert patch(a, b).max_abs_diff(b) == 0.0


def test_patch_refuses_misaligned_and_out_of_range():
    a, b = _rand_cache(2, 10, 0), _rand_cache(2, 11, 1)
    with pytest.raises(ValueError, match="aligned"):
        patch(a, b, [0])
    with pytest.raises(IndexError, match="positions"):
        patch(a, _rand_cache(2, 10, 1), [10])
    with pytest.raises(IndexError, match="layers"):
        patch(a, _rand_cache(2, 10, 1), [0], layers=[5])


def test_dynamic_roundtrip_and_forward_never_write_back(tiny):
    a = _rand_cache(3, 7, 0)
    assert KVCache.from_dynamic(a.to_dynamic()).max_abs_diff(a) == 0.0
    g = torch.Generator().manual_seed(5)
    c = run.prefill(tiny, torch.randint(0, 128, (1, 12), generator=g)).cache
    before = c.clone()
    dyn = c.to_dynamic()
    with torch.inference_mode():  # model.generate-style use of the DynamicCache
        tiny.hf(input_ids=torch.tensor([[1, 2]]), past_key_values=dyn, use_cache=True)
    assert dyn.get_seq_length() == 14 and c.max_abs_diff(before) == 0.0


def test_cat_slice_select_stack():
    a = _rand_cache(2, 10, 0)
    assert cat([a.slice(0, 4), a.slice(4)]).max_abs_diff(a) == 0.0
    assert a.select([1, 3]).seq_len == 2
    s = stack([a, _rand_cache(2, 10, 1)])
    assert s.batch == 2 and s.batch_item(0).max_abs_diff(a) == 0.0
    with pytest.raises(ValueError, match="different lengths"):
        stack([a, _rand_cache(2, 9, 1)])


def test_slots_buffers_copy_once_and_refuse_overflow():
    """The buffers a forward writes into: the cache in [:n] (broadcast over a batch), room after."""
    from kvnotes.engine.cache import buffers, dynamic, from_slots, slots_class

    c = _rand_cache(2, 5, 0)
    keys, values = buffers(c, room=3, batch=2, device=torch.device("cpu"))
    assert keys[0].shape == (2, 2, 8, 8) and torch.equal(keys[0][1, :, :5], c.keys[0][0])
    layers = [slots_class()(k, v, 5, 3) for k, v in zip(keys, values)]
    past = dynamic(layers)
    new = torch.randn(2, 2, 3, 8)
    k_all, _ = layers[0].update(new, new)
    layers[1].update(new, new)
    assert past.get_seq_length() == 8 and torch.equal(k_all[:, :, 5:], new)
    assert from_slots(past).seq_len == 8 and c.seq_len == 5  # the source cache is untouched
    with pytest.raises(RuntimeError, match="holds 8 positions"):
        layers[0].update(new[:, :, :1], new[:, :, :1])
