"""Chained edits (issue #34): an EditResult edits and transplants again from its own cache, and the
chain agrees with doing the last step from scratch where the strategies are exact."""

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes import EditableCache, EditResult
from kvnotes.compose import splice
from kvnotes.edit.editable import demo_prompt
from kvnotes.engine import run
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def ec(request):
    return EditableCache(tiny_model(request.param), demo_prompt())


def _clean(r: EditResult) -> torch.Tensor:
    return run.prefill(r.model, list(r.ids)).logits[0, -1]


def test_edit_then_transplant_then_edit_equals_a_clean_prefill(ec):
    r1 = ec.edit("account_role: admin", "account_role: guest", strategy="erratum", insert_before="Request:")
    blk = splice.prefill_block(ec.model, ec._encode("Skill: refunds need a receipt.\n"))
    r2 = r1.transplant(blk, seam=len(blk), insert_before="Request:")
    r3 = r2.edit("audit dashboard", "billing page", strategy="full_downstream")
    assert "[STATE UPDATE] account_role has changed to guest" in r3.text
    assert "Skill: refunds need a receipt." in r3.text and "billing page" in r3.text
    assert r3.ids == EditableCache(ec.model, r3.text).ids  # the same tokens as the text from scratch
    for r in (r1, r2, r3):
        assert r.cache.seq_len == len(r.ids) - 1
        assert (r.next_token_logits() - _clean(r)).abs().max().item() <= ATOL_FP32
    # nothing started over: each step kept the previous cache up to where it changed
    b = next(i for i, (x, y) in enumerate(zip(r1.ids, r2.ids)) if x != y)
    assert r2.cache.slice(0, b).max_abs_diff(r1.cache.slice(0, b)) == 0.0
    assert r3.recomputed < len(r3.ids) - b


def test_chained_edit_agrees_with_the_same_edit_from_scratch(ec):
    r1 = ec.edit("account_role: admin", "account_role: guest", strategy="full_downstream")
    for strategy in ("field_only", "erratum", "full_downstream"):
        chained = r1.edit("audit", "sales", strategy=strategy)
        fresh = EditableCache(ec.model, r1.text).edit("audit", "sales", strategy=strategy)
        assert chained.ids == fresh.ids and chained.recomputed == fresh.recomputed
        assert (chained.next_token_logits() - fresh.next_token_logits()).abs().max().item() <= ATOL_FP32


def test_a_chain_keeps_its_errors(ec):
    from kvnotes import EditError

    r1 = ec.edit("account_role: admin", "account_role: guest", strategy="full_downstream")
    with pytest.raises(EditError, match="'account_role: admin' is not in the prompt"):
        r1.edit("account_role: admin", "account_role: root")


def test_a_seam_that_tokenizes_otherwise_is_recomputed_once(ec):
    """A block of one space before 'Request:' reads ' Request:' as text, which the tokenizer
    splits another way (' R' is one token): the chain re-syncs from there and stays exact."""
    space = splice.prefill_block(ec.model, ec._encode(" "))
    r2 = ec.transplant(space, seam=1, insert_before="Request:")
    assert ec._encode(r2.text) != r2.ids
    r3 = r2.edit("account_role: admin", "account_role: guest", strategy="erratum")
    assert r3.ids == ec._encode(r3.text)
    assert (r3.next_token_logits() - _clean(r3)).abs().max().item() <= ATOL_FP32
    seam = r2.text.index(" Request:")
    assert r3.recomputed > len(ec._encode(r2.text[seam:])) - 2  # the re-synced tail is counted


@pytest.mark.real
def test_real_chain_equals_a_clean_prefill(llama):
    ec = EditableCache(llama, demo_prompt())
    r1 = ec.edit("account_role: admin", "account_role: guest", strategy="erratum", insert_before="Request:")
    blk = splice.prefill_block(llama, ec._encode("Skill: refunds need a receipt.\n"))
    r3 = r1.transplant(blk, seam=len(blk), insert_before="Request:").edit("audit", "sales", strategy="full_downstream")
    assert r3.ids == ec._encode(r3.text)
    assert (r3.next_token_logits() - _clean(r3)).abs().max().item() <= 1e-4
