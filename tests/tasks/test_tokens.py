"""Decision readout and piecewise tokenization, for every registered tokenizer."""

from __future__ import annotations

import pytest

from kvnotes.tasks import DecisionTokenError, build_suite
from kvnotes.tasks.domains import builtin_domains
from kvnotes.tasks.memory import facts
from kvnotes.tasks.skills import skills
from kvnotes.tasks.tokens import (
    AlignmentError,
    Piece,
    assemble,
    check_alignment,
    decision_ids,
    encode,
    frame,
    is_aggregator,
    pad_id,
)


def _all_outcome_sets():
    yield from (d.outcomes for d in builtin_domains().values())
    yield from (s.outcomes for s in skills().values())
    yield from (f.outcomes for f in facts().values())


def test_decision_tokens_are_distinct_for_every_tokenizer(named_tok):
    _, tok, _ = named_tok
    for outcomes in _all_outcome_sets():
        for context in ("Next action:", "<|im_start|>assistant\n", "Answer:"):
            ids = decision_ids(tok, outcomes, context)
            assert len(set(ids)) == len(outcomes)


def test_decision_token_is_the_first_token_after_the_prompt(named_tok):
    _, tok, chat = named_tok
    it = build_suite("gated", tok, chat=chat, n_items=1, length=300)[0]
    for o, i in zip(it.outcomes, it.decision_ids, strict=True):
        answer = encode(tok, " " + o)  # the prompt ends with "Next action:"
        assert i == answer[0]
        assert encode(tok, it.old_text + " " + o)[-len(answer) :] == answer  # same in context


def test_shared_first_token_is_refused_clearly(qwen_tok):
    with pytest.raises(DecisionTokenError, match="share their first token .*choose outcome words"):
        decision_ids(qwen_tok, ["issue_refund", "issue_credit"], "Next action:")


def test_pad_is_a_single_neutral_token(named_tok):
    _, tok, _ = named_tok
    assert tok.decode([pad_id(tok)]) in (" ", ".")


def test_assemble_pads_the_shorter_value(qwen_tok):
    pieces = [Piece("status:"), Piece(" ok", alt=" extraordinarily_complicated"), Piece("\nend")]
    a = assemble(qwen_tok, pieces)
    s, e = a.span
    assert len(a.old_ids) == len(a.new_ids) and e - s == len(encode(qwen_tok, " extraordinarily_complicated"))
    assert a.old_ids[s + 1 :e] == (pad_id(qwen_tok),) * (e - s - 1)
    assert a.old_ids == tuple(encode(qwen_tok, "status:") + list(a.old_ids[s:e]) + encode(qwen_tok, "\nend"))


def test_alignment_check_catches_differences_outside_the_span():
    check_alignment([1, 2, 3], [1, 5, 3], (1, 2))
    with pytest.raises(AlignmentError, match="outside"):
        check_alignment([1, 2, 3], [1, 5, 4], (1, 2))
    with pytest.raises(AlignmentError, match="tokens"):
        check_alignment([1, 2, 3], [1, 2], (1, 2))
    with pytest.raises(AlignmentError, match="identical"):
        check_alignment([1, 2, 3], [1, 2, 3], (1, 2))


def test_frames(qwen_tok, gemma_tok):
    f = frame(qwen_tok, True)
    assert f.chat and f.head.startswith("<|im_start|>system") and f.tail.endswith("assistant\n")
    g = frame(gemma_tok, True)  # gemma-3-270m base has no chat template: completion text
    assert not g.chat and g.head == "<bos>"
    assert not frame(qwen_tok, False).chat


def test_aggregators():
    assert is_aggregator("\n") and is_aggregator(".") and is_aggregator(":\n") and is_aggregator(" ")
    assert not is_aggregator(" order") and not is_aggregator("ship")


def _char_tokenizer():
    """Every character its own token, spaces too."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>", "\n", *(chr(c) for c in range(32, 127))]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_character_tokenizers_get_distinct_decision_tokens():
    """With a space as its own token the prompt ends with the space, so the outcomes' first
    characters are the decision tokens; the tiny models' tokenizer merges ' x' and needs none."""
    from kvnotes.models.tiny import tiny_tokenizer

    for tok, tail in ((_char_tokenizer(), ": "), (tiny_tokenizer(), ":")):
        for suite in ("gated", "skills", "memory", "gated-control"):
            for it in build_suite(suite, tok, chat=True, n_items=12, length=1500):
                assert it.old_text.endswith(tail) and len(set(it.decision_ids)) == len(it.outcomes)
                firsts = [tok.decode([i]).strip() for i in it.decision_ids]
                assert firsts == [o[0] for o in it.outcomes]
