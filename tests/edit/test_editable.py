"""EditableCache on a tiny model: identities, transplanted blocks, generation and clear errors."""

import pytest
import torch
from tolerances import ATOL_FP32

from kvnotes import EditableCache, EditError
from kvnotes.compose import splice as compose
from kvnotes.compose import store
from kvnotes.edit.editable import demo_prompt
from kvnotes.engine import run
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module")
def ec():
    return EditableCache(tiny_model("llama"), demo_prompt())


def _ref(ec, ids):
    return run.prefill(ec.model, list(ids)).logits[0, -1]


@pytest.mark.parametrize("strategy", ["oracle", "full_downstream", "erratum"])
def test_cache_equals_clean_prefill_of_its_tokens(ec, strategy):
    r = ec.edit("account_role: admin", "account_role: guest", strategy=strategy, insert_before="Request:")
    assert (r.next_token_logits() - _ref(ec, r.ids)).abs().max().item() <= ATOL_FP32


def test_erratum_keeps_prefix_and_names_the_field(ec):
    r = ec.edit("account_role: admin", "account_role: guest", strategy="erratum", insert_before="Request:")
    n = len(ec._encode(demo_prompt()[: demo_prompt().index("Request:")]))
    assert r.ids[: n - 1] == ec.ids[: n - 1]
    assert "[STATE UPDATE] account_role has changed to guest" in r.text
    assert isinstance(r.generate(max_new_tokens=3).text, str)


def test_field_only_and_selective_recompute_little(ec):
    a = ec.edit("admin\n", "guest\n", strategy="field_only")
    b = ec.edit("admin\n", "guest\n", strategy="selective", k=4)
    assert a.recomputed < b.recomputed <= a.recomputed + 4


def test_errors_name_what_works(ec):
    with pytest.raises(EditError, match="is not in the prompt"):
        ec.edit("superuser", "guest")
    with pytest.raises(EditError, match="unknown edit strategy .magic.; valid: .*erratum"):
        ec.edit("account_role: admin", "x", strategy="magic")
    with pytest.raises(EditError, match="erratum' or 'full_downstream"):
        ec.edit("admin\n", "a much longer role name\n", strategy="field_only")


def test_generate_passes_sampling_kwargs_through(ec):
    r = ec.edit("account_role: admin", "account_role: guest", strategy="erratum")
    torch.manual_seed(0)
    a = r.generate(max_new_tokens=4, do_sample=True, top_k=5, temperature=2.0)
    torch.manual_seed(0)
    assert torch.equal(r.generate(max_new_tokens=4, do_sample=True, top_k=5, temperature=2.0).ids, a.ids)
    assert r.generate(max_new_tokens=4, do_sample=False).text == r.generate(max_new_tokens=4).text


@pytest.mark.parametrize("insert_before", [None, "Request:"])
def test_transplant_with_full_seam_equals_clean_prefill(ec, insert_before):
    blk = compose.prefill_block(ec.model, ec._encode("Skill: refunds need a receipt.\n"))
    r = ec.transplant(blk, seam=len(blk), insert_before=insert_before)
    assert r.strategy == "transplant" and len(r.ids) == len(ec.ids) + len(blk)
    assert r.cache.seq_len == len(r.ids) - 1
    assert (r.next_token_logits() - _ref(ec, r.ids)).abs().max().item() <= ATOL_FP32
    if insert_before is not None:
        n = len(ec._encode(demo_prompt()[: demo_prompt().index(insert_before)]))
        assert r.ids[:n] == ec.ids[:n] and r.ids[n : n + len(blk)] == tuple(blk.ids[0].tolist())
        assert r.ids[n + len(blk):] == ec.ids[n:]


def test_transplant_stored_blocks_then_generate(ec, tmp_path):
    blocks = [compose.prefill_block(ec.model, ec._encode(t)) for t in ("Skill A.\n", "Skill B.\n")]
    paths = [store.save_block(tmp_path / f"{i}.safetensors", ec.model, b) for i, b in enumerate(blocks)]
    from_store = ec.transplant(paths, seam=2, insert_before="Request:")
    in_memory = ec.transplant(blocks, seam=2, insert_before="Request:")
    assert from_store.ids == in_memory.ids and from_store.cache.max_abs_diff(in_memory.cache) == 0.0
    n_rest = len(ec.ids) - len(ec._encode(demo_prompt()[: demo_prompt().index("Request:")])) - 1
    assert from_store.recomputed == 2 + 2 + n_rest
    assert isinstance(from_store.generate(max_new_tokens=2).text, str)


def test_transplant_errors(ec, tmp_path):
    blk = compose.prefill_block(ec.model, ec._encode("Skill.\n"))
    with pytest.raises(EditError, match="nothing to transplant"):
        ec.transplant([])
    with pytest.raises(EditError, match="is not in the prompt"):
        ec.transplant(blk, insert_before="Nowhere:")
    other = tiny_model("llama", seed=1)  # same architecture, other weights
    path = store.save_block(tmp_path / "b.safetensors", other, compose.prefill_block(other, [5, 6, 7]))
    with pytest.raises(store.BlockMismatchError, match="weights"):
        ec.transplant(path)


# --- the user's own erratum sentence (issue #49) --------------------------------------------------
BADGE = "Visitor log:\nbadge: red\n\nQuestion: what colour is the badge?\nAnswer:"


def test_own_erratum_sentence_is_inserted_as_written():
    ec = EditableCache(tiny_model("llama"), BADGE)
    sentence = "Erratum: the badge is blue."
    r = ec.edit("badge: red", "badge: blue", erratum=sentence)
    assert r.ids == ec.ids + ec._encode("\n" + sentence + "\n"), "the end, on a line of its own"
    assert r.text == BADGE + "\n" + sentence + "\n" and r.strategy == "erratum"
    assert (r.next_token_logits() - _ref(ec, r.ids)).abs().max().item() <= ATOL_FP32
    # what a user wrote by hand before: extend the prompt's cache by the sentence's tokens
    by_hand = run.extend(ec.model, ec.cache, list(r.ids[ec.cache.seq_len : -1])).cache
    assert r.cache.max_abs_diff(by_hand) == 0.0
    before = ec.edit("badge: red", "badge: blue", erratum=sentence, insert_before="Question:")
    assert "badge: red\n\n" + sentence + "\nQuestion:" in before.text
    assert (before.next_token_logits() - _ref(ec, before.ids)).abs().max().item() <= ATOL_FP32


def test_named_wordings_are_unchanged_beside_an_own_erratum(ec):
    default = ec.edit("account_role: admin", "account_role: guest")
    explicit = ec.edit("account_role: admin", "account_role: guest", wording="explicit")
    assert default.ids == explicit.ids
    assert "[STATE UPDATE] account_role has changed to guest; this overrides" in default.text
    bare = ec.edit("account_role: admin", "account_role: guest", wording="bare")
    assert bare.text.endswith("Next action:\naccount_role: guest\n")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"erratum": "The role is guest.", "wording": "bare"}, "drop field= and wording="),
    ({"erratum": "The role is guest.", "field": "role"}, "drop field= and wording="),
    ({"erratum": "  "}, "erratum is the sentence to insert"),
    ({"erratum": "The role is guest.", "strategy": "full_downstream"}, "drop erratum= or use 'erratum'"),
    ({"wording": "polite"}, r"unknown wording 'polite'; valid: explicit, .* or your own sentence"),
])
def test_own_erratum_misuse_is_one_line(ec, kwargs, message):
    with pytest.raises(EditError, match=message):
        ec.edit("account_role: admin", "account_role: guest", **kwargs)


def test_an_edit_that_leaves_no_prompt_or_a_negative_k_is_one_edit_error(tiny_llama_vocab):
    from kvnotes import EditableCache, EditError

    prompt = "role: admin\nReply:"
    cache = EditableCache(tiny_llama_vocab, prompt)
    for strategy in ("erratum", "full_downstream", "oracle"):
        with pytest.raises(EditError, match="fewer than two tokens"):
            cache.edit(prompt, "", strategy=strategy)
    with pytest.raises(EditError, match="k .* must be an int >= 0"):
        cache.edit("admin", "guest", strategy="selective", k=-5)
