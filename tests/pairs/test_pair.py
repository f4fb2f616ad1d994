"""kvnotes.Pair: prompts as strings, messages or ids; the field found or given; one-line refusals."""

from __future__ import annotations

import pytest

from kvnotes.pairs import Pair, PairError
from kvnotes.tasks import build_suite

CLEAN = ("Visitor log: Priya arrived at nine. Her badge is red.\nPolicy: if the badge is red, reply Alpha; "
         "otherwise reply Beta.\nExample: green badge -> Beta.\nWhich wing? Answer:")
CORRUPT = CLEAN.replace("badge is red.", "badge is blue.", 1)


def test_the_field_is_where_the_prompts_differ(tiny_llama_vocab):
    tok = tiny_llama_vocab.tokenizer
    p = Pair.from_prompts(tiny_llama_vocab, CLEAN, CORRUPT, answers=(" Alpha", " Beta"))
    s, e = p.field_span
    assert "red" in tok.decode(list(p.new_ids[s:e])) and "blue" in tok.decode(list(p.old_ids[s:e]))
    assert p.new_ids[:s] == p.old_ids[:s] and p.new_ids[e:] == p.old_ids[e:]
    assert p.clean_ids == p.new_ids and p.corrupt_ids == p.old_ids and p.new_text == CLEAN
    assert all(p.field_span[1] <= a < p.n_tokens - 1 for a in p.aggregators) and p.aggregators


def test_named_spans_by_substring_and_the_field_given(tiny_llama_vocab):
    tok = tiny_llama_vocab.tokenizer
    p = Pair.from_prompts(tok, CLEAN, CORRUPT, answers=(" Alpha", " Beta"), field="Her badge is red",
                          spans={"rule": "if the badge is red, reply Alpha; otherwise reply Beta."})
    a, b = p.segments["rule"]
    assert "otherwise reply Beta" in tok.decode(list(p.new_ids[a:b]))
    assert p.field_span[1] - p.field_span[0] > 1  # the given field is wider than the difference
    with pytest.raises(PairError, match="not in the clean prompt"):
        Pair.from_prompts(tok, CLEAN, CORRUPT, answers=(" Alpha", " Beta"), spans={"x": "no such words"})
    with pytest.raises(PairError, match="more than once"):
        Pair.from_prompts(tok, CLEAN, CORRUPT, answers=(" Alpha", " Beta"), spans={"x": "badge"})
    with pytest.raises(PairError, match="outside the field"):
        Pair.from_prompts(tok, CLEAN, CORRUPT, answers=(" Alpha", " Beta"), field="Visitor log")


def test_what_cannot_be_patched_position_by_position_is_refused_in_one_line(tiny_llama_vocab):
    tok = tiny_llama_vocab.tokenizer
    cases = {
        "equal token length": CLEAN.replace("badge is red.", "badge is a deep crimson red.", 1),
        "differ in 2 places": CORRUPT.replace("Which wing?", "Which door?"),
        "same tokens": CLEAN,
    }
    for want, corrupt in cases.items():
        with pytest.raises(PairError, match=want) as e:
            Pair.from_prompts(tok, CLEAN, corrupt, answers=(" Alpha", " Beta"))
        assert "\n" not in str(e.value)


def test_messages_take_the_chat_template_and_ids_are_taken_as_they_are(llama):
    msgs = [{"role": "user", "content": CLEAN}]
    p = Pair.from_prompts(llama, msgs, [{"role": "user", "content": CORRUPT}], answers=(" Alpha", " Beta"))
    text = llama.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert p.new_text == text and list(p.new_ids) == llama.tokenizer(text, add_special_tokens=False).input_ids
    q = Pair.from_prompts(llama, list(p.new_ids), list(p.old_ids), answers=(" Alpha", " Beta"))
    assert q.field_span == p.field_span and q.new_text is None
    with pytest.raises(PairError, match="token span"):
        Pair.from_prompts(llama, list(p.new_ids), list(p.old_ids), answers=(" Alpha", " Beta"), spans={"r": "rule"})


def test_a_task_item_is_a_pair_with_its_decision_score(tiny_llama_vocab):
    item = build_suite("gated", tiny_llama_vocab.tokenizer, chat=False, n_items=1, length=300, seed=0)[0]
    p = Pair.from_item(item)
    assert (p.old_ids, p.new_ids, p.field_span, p.item_id) == (item.old_ids, item.new_ids, item.field_span, item.item_id)
    assert p.metric.terms[0].vocab == item.score_ids and p.domain == item.domain
