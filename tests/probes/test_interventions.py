"""kvnotes.engine.interp's batched interventions against their references, on tiny models of several families.

hide_keys: no hidden key is the plain forward; hiding only the key just before the decision is
the decision-only knockout (no other query comes after it). patch_heads_at_tail: equal to the
nnsight head patch of the whole prompts; all heads patched at the last token is the new run.
"""

import pytest
import torch

from kvnotes import tasks
from kvnotes.edit.patching import make_pair
from kvnotes.engine import interp
from kvnotes.engine.run import full_logits
from kvnotes.engine.variants import read_variants
from kvnotes.models.tiny import tiny_model

FAMILIES = ["llama", "gemma2", "mistral"]  # gemma2 / mistral: sliding windows shorter than the prompt


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, one_thread):
    model = tiny_model(request.param)
    item = tasks.build_suite("gated", model.tokenizer, chat=False, n_items=1, length=700, seed=0)[0]
    return model, item, make_pair(model, item)


def test_hide_keys_matches_its_references(setup):
    model, item, pair = setup
    n = item.n_tokens
    hidden = torch.zeros(3, n, dtype=torch.bool)
    hidden[1, n - 2] = True
    hidden[2, item.field_span[1] : n - 5] = True
    logits = interp.hide_keys(model, item.new_ids, hidden, batch_size=2)
    ref = full_logits(model, item.new_ids)[0, -1]
    torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=1e-4)
    key_mask = torch.zeros(1, n - 1, dtype=torch.bool)
    key_mask[0, n - 2] = True
    decision_only = read_variants(model, pair.new, pair.new, [[]], pair.tail, key_mask=key_mask)[0, -1]
    torch.testing.assert_close(logits[1], decision_only, atol=1e-4, rtol=1e-4)
    assert (logits[2] - ref).abs().max() > 1e-3  # hiding the notes changes the decision logits


def test_hide_keys_refuses_a_misshapen_mask(setup):
    model, item, _ = setup
    with pytest.raises(ValueError, match="hidden must be"):
        interp.hide_keys(model, item.new_ids, torch.zeros(1, item.n_tokens - 1, dtype=torch.bool))


def test_patch_heads_at_tail_equals_the_nnsight_patch(setup):
    model, item, pair = setup
    L, H = model.n_layers, model.adapter.n_heads(model.hf)
    heads = [(0, 1), (1, 0), (L - 1, H - 1)]
    ref = interp.patch_head_outputs(model, item.old_ids, item.new_ids, heads)
    z = interp.tail_head_outputs(model, pair.new, pair.tail)
    masks = torch.zeros(3, L, H, dtype=torch.bool)
    for layer, head in heads:
        masks[1, layer, head] = True
    masks[2] = True
    out = interp.patch_heads_at_tail(model, pair.old, pair.tail, z, masks, batch_size=2)
    torch.testing.assert_close(out[1], ref, atol=1e-4, rtol=1e-4)
    stale = read_variants(model, pair.old, pair.old, [[]], pair.tail)[0, -1]
    oracle = read_variants(model, pair.new, pair.new, [[]], pair.tail)[0, -1]
    torch.testing.assert_close(out[0], stale, atol=1e-4, rtol=1e-4)  # no head: the old run
    torch.testing.assert_close(out[2], oracle, atol=1e-4, rtol=1e-4)  # every head: the new run
    with pytest.raises(ValueError, match="heads must be"):
        interp.patch_heads_at_tail(model, pair.old, pair.tail, z, masks[:, :1])
