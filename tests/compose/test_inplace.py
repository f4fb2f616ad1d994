"""Blocks attended in place (kvnotes.compose.inplace, kvnotes.engine.segments) against today's
transplant: logits, the resulting cache and what a later forward reads from it, on every tiny
family and every rope scaling a transplant accepts; the rest refused in one line."""

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes.compose import splice as compose
from kvnotes.compose.inplace import segments_of, transplant_extend_inplace
from kvnotes.engine import run
from kvnotes.engine.segments import Segment, SegmentedCache, extend_segments
from kvnotes.models.rope_types import UnsupportedRopeError


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _llama_with_rope(rope):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvnotes.models import wrap_model
    from kvnotes.models.adapters.base import TINY_COMMON
    from kvnotes.models.tiny import tiny_tokenizer

    cfg = LlamaConfig(**TINY_COMMON, rope_parameters=rope)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return wrap_model(AutoModelForCausalLM.from_config(cfg), tiny_tokenizer(), name=f"tiny-{rope['rope_type']}")


def _compare(model, seam):
    """(logits, cache, next forward) max abs differences of in place vs transplant_extend."""
    pre = run.prefill(model, _ids(13, 0)).cache
    # 13 + 20 + 5 + 30 + 6 positions: past the sliding windows (24) and llama3's/YaRN's 64
    blocks = [compose.prefill_block(model, _ids(n, s)) for n, s in ((20, 1), (5, 2), (30, 3))]
    q, more = _ids(6, 4), _ids(3, 5)
    want = compose.transplant_extend(model, pre, blocks, seam, q, logits_to_keep=0)
    got = transplant_extend_inplace(model, pre, blocks, seam, q, logits_to_keep=0)
    after = run.extend(model, want.cache, more, logits_to_keep=0).logits
    after_got = extend_segments(model, got.cache, more, logits_to_keep=0).logits
    assert got.logits is not None and after_got is not None
    return ((got.logits - want.logits).abs().max().item(),
            got.cache.materialize(model).max_abs_diff(want.cache),
            (after_got - after).abs().max().item())


@pytest.mark.parametrize("seam", [0, 2, 100])
def test_in_place_equals_transplant_on_every_family(tiny, seam, one_thread):
    assert max(_compare(tiny, seam)) <= ATOL_FP32


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.7},  # attention_scaling far from 1: it must stay in the query only
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
])
def test_in_place_equals_transplant_under_every_static_rope_scaling(rope, one_thread):
    m = _llama_with_rope(rope)
    if rope["rope_type"] == "yarn":
        assert m.adapter._attention_scaling(m.hf, 0) == pytest.approx(1.7)
    assert max(_compare(m, 2)) <= ATOL_FP32


def test_dynamic_rope_is_refused_in_one_line_before_any_forward(one_thread):
    m = _llama_with_rope({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    pre = run.prefill(m, _ids(5, 0)).cache
    blk = compose.prefill_block(m, _ids(6, 1))
    calls = []
    handle = m.adapter.decoder(m.hf).register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(UnsupportedRopeError, match="dynamic") as e:
            transplant_extend_inplace(m, pre, [blk], 0, _ids(3, 2))
    finally:
        handle.remove()
    assert not calls and "\n" not in str(e.value)


def test_blocks_are_read_where_they_lie(one_thread):
    from kvnotes.models.tiny import tiny_model

    m = tiny_model("llama")
    blk = compose.prefill_block(m, _ids(12, 1))
    step = transplant_extend_inplace(m, run.prefill(m, _ids(7, 0)).cache, [blk], 4, _ids(3, 2))
    seg = step.cache.segments[1]
    assert seg.shift == 7 and seg.positions.tolist() == list(range(11, 19))
    # the block's own tensors, not a copy and not a rotation
    assert all(k.data_ptr() == b[:, :, 4:].data_ptr() for k, b in zip(seg.keys, blk.cache.keys))


def test_segment_positions_are_checked():
    from kvnotes.models.tiny import tiny_model

    m = tiny_model("llama")
    c = run.prefill(m, _ids(5, 0)).cache
    cache = SegmentedCache((Segment.span(c, 0),))
    with pytest.raises(IndexError, match="already held"):
        extend_segments(m, cache, _ids(1, 1), [3])
    with pytest.raises(IndexError, match="appended"):
        extend_segments(m, cache, _ids(1, 1), [7])
    with pytest.raises(ValueError, match="once each"):
        SegmentedCache((Segment.span(c, 0), Segment.span(c, 2))).materialize(m)
    segs, pos, _ = segments_of(m, c, [compose.prefill_block(m, _ids(4, 1))], 10)
    assert pos.tolist() == [5, 6, 7, 8] and len(segs.segments) == 1
