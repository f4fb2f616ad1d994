"""Splicing precompiled blocks: seam K = L is the full recompute; K = 0 is close on real models."""

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes.compose import splice as compose
from kvnotes.engine import run


def _ids(n, seed):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_seam_full_length_equals_full_recompute(tiny):
    prefix, block = _ids(30, 0), _ids(20, 1)
    pre = run.prefill(tiny, prefix).cache
    b = compose.prefill_block(tiny, block)
    spliced = compose.splice(tiny, pre, b, seam=len(b))
    full = run.prefill(tiny, torch.cat([prefix, block], 1)).cache
    assert spliced.max_abs_diff(full) <= ATOL_FP32


def test_splice_at_zero_is_the_block(tiny):
    b = compose.prefill_block(tiny, _ids(10, 2))
    assert compose.splice(tiny, None, b).max_abs_diff(b.cache) == 0.0


def test_splice_partial_seam_keeps_length_and_prefix(tiny):
    prefix, block = _ids(15, 0), _ids(12, 1)
    pre = run.prefill(tiny, prefix).cache
    out = compose.splice(tiny, pre, compose.prefill_block(tiny, block), seam=3)
    assert out.seq_len == 27
    assert out.slice(0, 15).max_abs_diff(pre) == 0.0


def test_splice_many_and_bad_seam(tiny):
    blocks = [compose.prefill_block(tiny, _ids(8, s)) for s in range(3)]
    out = compose.splice_many(tiny, None, blocks, seam=8)
    full = run.prefill(tiny, compose.block_ids(blocks)).cache
    assert out.max_abs_diff(full) <= ATOL_FP32
    with pytest.raises(ValueError, match="seam"):
        compose.splice(tiny, None, blocks[0], seam=-1)


def test_splice_and_transplant_follow_one_seam_rule(tiny):
    """A seam longer than a block recomputes all of it, in both; a bad seam is refused by both
    with the same line (issue #49: splice refused seam > L, transplant took it)."""
    pre = run.prefill(tiny, _ids(10, 0)).cache
    blocks = [compose.prefill_block(tiny, _ids(n, s)) for n, s in ((8, 1), (5, 2))]
    longer = compose.splice_many(tiny, pre, blocks, seam=6)  # > the second block's 5 tokens
    assert longer.max_abs_diff(compose.transplant(tiny, pre, blocks, 6)) <= ATOL_FP32
    whole = compose.splice(tiny, pre, blocks[0], seam=100)
    assert whole.max_abs_diff(compose.splice(tiny, pre, blocks[0], seam=len(blocks[0]))) == 0.0
    assert whole.max_abs_diff(compose.transplant(tiny, pre, blocks[0], 100)) <= ATOL_FP32
    for bad in (-1, 2.5, "4", True):
        with pytest.raises(ValueError) as by_splice:
            compose.splice(tiny, pre, blocks[0], seam=bad)
        with pytest.raises(ValueError) as by_transplant:
            compose.transplant(tiny, pre, blocks, bad)
        assert str(by_splice.value) == str(by_transplant.value) == f"seam must be an int >= 0, got {bad!r}"
    assert [compose.seam_tokens(k, 5) for k in (0, 3, 5, 9)] == [0, 3, 5, 5]


@pytest.mark.real
def test_real_llama_splice_fidelity(llama):
    tok = llama.tokenizer
    prefix = tok("You are a support agent. Follow the policy below.\n", return_tensors="pt").input_ids
    block = tok("Policy: refunds are issued only for orders that have not shipped. "
                "Shipped orders must be escalated to a human.\n", return_tensors="pt").input_ids
    q = tok("Question: the order has shipped. Next action:", return_tensors="pt").input_ids
    full_ids = torch.cat([prefix, block, q], 1)
    ref = run.full_logits(llama, full_ids)[0, -1]
    pre = run.prefill(llama, prefix).cache
    b = compose.prefill_block(llama, block)
    exact = run.extend(llama, compose.splice(llama, pre, b, seam=len(b)), q).logits[0, -1]
    assert (exact - ref).abs().max().item() <= ATOL_FP32
    got = run.extend(llama, compose.splice(llama, pre, b, seam=0), q).logits[0, -1]
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
    assert cos > 0.9, cos


# --- the transplant fast path: one forward for every seam (and the question) ---------------------


def _count_forwards(model):
    calls = []
    handle = model.adapter.decoder(model.hf).register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("seam", [0, 2, 100])
def test_transplant_extend_equals_transplant_then_extend(tiny, seam):
    pre = run.prefill(tiny, _ids(13, 0)).cache
    blocks = [compose.prefill_block(tiny, _ids(n, s)) for n, s in ((9, 1), (5, 2), (11, 3))]
    q = _ids(6, 4)
    want = run.extend(tiny, compose.transplant(tiny, pre, blocks, seam), q, logits_to_keep=0)
    calls, handle = _count_forwards(tiny)
    try:
        got = compose.transplant_extend(tiny, pre, blocks, seam, q, logits_to_keep=0)
    finally:
        handle.remove()
    assert len(calls) == 1  # seams of all blocks and the question: one forward
    assert (got.logits - want.logits).abs().max().item() <= ATOL_FP32
    assert got.cache.max_abs_diff(want.cache) <= ATOL_FP32


def test_multi_block_seams_are_repaired_in_one_forward(tiny):
    blocks = [compose.prefill_block(tiny, _ids(8, s)) for s in range(4)]
    pre = run.prefill(tiny, _ids(5, 9)).cache
    calls, handle = _count_forwards(tiny)
    try:
        got = compose.transplant(tiny, pre, blocks, seam=3)
    finally:
        handle.remove()
    assert len(calls) == 1
    assert got.max_abs_diff(compose.splice_many(tiny, pre, blocks, seam=3)) <= ATOL_FP32
    full = run.prefill(tiny, torch.cat([_ids(5, 9), compose.block_ids(blocks)], 1)).cache
    assert compose.transplant(tiny, pre, blocks, seam=8).max_abs_diff(full) <= ATOL_FP32
