"""Suites render for every tokenizer: aligned, seeded, length-controlled, correct by construction."""

from __future__ import annotations

import pytest

from kvnotes.tasks import (
    TaskItem,
    UnknownSuiteError,
    build_suite,
    domain_names,
    load_suite,
    suite_names,
)
from kvnotes.tasks.tokens import check_alignment

ITEM_SUITES = [s for s in suite_names() if load_suite(s).kind != "agents"]


def _check_aligned(it: TaskItem) -> None:
    s, e = it.field_span
    assert len(it.old_ids) == len(it.new_ids)
    assert it.old_ids[:s] == it.new_ids[:s] and it.old_ids[e:] == it.new_ids[e:]
    assert it.old_ids[s:e] != it.new_ids[s:e]
    check_alignment(it.old_ids, it.new_ids, it.field_span)
    assert it.downstream == (e, it.n_tokens) and it.decision_pos == it.n_tokens - 1
    assert all(e <= p < it.n_tokens for p in it.aggregators) and it.aggregators


def test_suites_and_domains_are_listed():
    assert {"gated", "gated-control", "gated-polarity", "gated-trigger", "skills", "memory",
            "agents"} <= set(suite_names())
    assert len(domain_names()) >= 10


def test_unknown_suite_lists_valid_ones(qwen_tok):
    with pytest.raises(UnknownSuiteError, match="valid suites: .*gated"):
        build_suite("gatd", qwen_tok)


@pytest.mark.parametrize("suite", ITEM_SUITES)
def test_every_suite_renders_aligned_for_every_tokenizer(named_tok, suite):
    name, tok, chat = named_tok
    n = 24 if suite.startswith("gated") else 10  # every domain, skill or fact at least once
    items = build_suite(suite, tok, chat=chat, n_items=n, seed=1)
    for it in items:
        _check_aligned(it)
        assert it.chat == chat
        text = it.old_text if chat else ""
        assert not chat or "assistant" in text.lower() or "model" in text.lower()
    assert len({it.domain for it in items}) == min(n, len(load_suite(suite).domains) or 10)


def test_every_domain_renders_chat_and_completion(qwen_tok, gemma_tok):
    for tok, chat in ((qwen_tok, True), (gemma_tok, False), (qwen_tok, False)):
        items = build_suite("gated", tok, chat=chat, n_items=2 * len(domain_names()), length=400)
        assert {it.domain for it in items} == set(domain_names())
        for it in items:
            _check_aligned(it)
            assert it.old_text.rstrip().endswith("Next action:")
            assert ("<|im_start|>" in it.old_text) == chat


def test_same_seed_same_items_other_seed_other_items(qwen_tok):
    a = build_suite("gated", qwen_tok, n_items=6, seed=3)
    b = build_suite("gated", qwen_tok, n_items=6, seed=3)
    c = build_suite("gated", qwen_tok, n_items=6, seed=4)
    assert a == b
    assert [x.old_ids for x in a] != [x.old_ids for x in c]


@pytest.mark.parametrize("length", [300, 1000, 4000, 8000])
def test_length_within_five_percent(named_tok, length):
    _, tok, chat = named_tok
    suites = ("gated", "skills", "memory") if length <= 1000 else ("gated",)
    for suite in suites:
        if suite != "gated" and length < 500:
            continue
        for it in build_suite(suite, tok, chat=chat, n_items=3, length=length, seed=length):
            assert abs(it.n_tokens - length) <= 0.05 * length, (suite, it.n_tokens)


def test_length_below_the_skeleton_is_refused(qwen_tok):
    with pytest.raises(ValueError, match="below the"):
        build_suite("gated", qwen_tok, n_items=1, length=50)


def test_values_outcomes_and_balance(qwen_tok):
    items = build_suite("gated", qwen_tok, n_items=48)
    for it in items:
        assert it.flips and it.correct_old != it.correct_new
        assert it.old_value in it.old_text and it.new_value in it.new_text
    # old value alternates: each outcome is the old-correct one for half the items
    first = sum(it.correct_old == it.outcomes[0] for it in items)
    assert first == len(items) // 2


def test_control_keeps_the_decision(qwen_tok):
    items = build_suite("gated-control", qwen_tok, n_items=24)
    assert {it.field_name for it in items} == {"request_id", "current_time"}
    for it in items:
        assert it.correct_old == it.correct_new and not it.flips
        assert it.cf_ids is None  # controls are read raw
        pos, neg = it.score_ids
        assert neg == it.decision_ids[it.index(it.correct_old)] and pos != neg


def test_polarity_2x2_is_balanced_and_inverts(qwen_tok):
    items = build_suite("gated-polarity", qwen_tok, n_items=48)
    cells = {(it.polarity, it.old_value == load_value(it, 0)) for it in items}
    assert len(cells) == 4
    for it in items:
        trig = "Unless" if it.polarity else "If"
        assert f"{trig} " in it.old_text[-700:]
    inverted = [it for it in items if it.polarity]
    same = [it for it in items if not it.polarity]
    assert inverted and same
    for a in inverted:
        b = next(x for x in same if x.domain == a.domain and x.old_value == a.old_value)
        assert a.correct_old == b.correct_new  # the trigger swaps the conclusion


def load_value(it: TaskItem, i: int) -> str:
    from kvnotes.tasks.domains import builtin_domains

    return builtin_domains()[it.domain].values[i]


def test_trigger_flips_only_the_trigger_word(qwen_tok):
    for it in build_suite("gated-trigger", qwen_tok, n_items=12):
        s, e = it.field_span
        assert {it.old_value, it.new_value} == {"If", "Unless"}
        assert qwen_tok.decode(it.old_ids[s:e]).strip() == it.old_value
        assert it.correct_old != it.correct_new
        field = load_suite("gated").domains[0].field  # any field line sits before the span
        assert field and s > it.segments["session"][1]


def test_design_overrides_and_domain_subset(qwen_tok):
    items = build_suite("gated", qwen_tok, n_items=4, domains=["refund", "visa"],
                        design={"rule_position": "policy", "fewshot": 0, "answer_prefix": False})
    assert {it.domain for it in items} == {"refund", "visa"}
    for it in items:
        assert "Examples" not in it.old_text and "Binding rule:" not in it.old_text
        assert it.old_text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="no domains"):
        build_suite("gated", qwen_tok, n_items=1, domains=["nope"])


def test_a_dropped_template_file_is_a_suite(tmp_path, qwen_tok):
    (tmp_path / "library.yaml").write_text(
        "kind: gated\n"
        "domains: [refund]\n"
        "extra_domains:\n"
        "  library:\n"
        "    role: a library assistant\n"
        "    field: card_status\n"
        "    values: [valid, blocked]\n"
        "    outcomes: [lend_book, ask_librarian]\n"
        "    requests: [I would like to borrow this book.]\n"
        "n_items: 4\nlength: 300\n"
    )
    assert "library" in suite_names([tmp_path])
    items = build_suite("library", qwen_tok, template_dirs=[tmp_path])
    assert {it.domain for it in items} == {"refund", "library"} and len(items) == 4
    assert all(abs(it.n_tokens - 300) <= 15 for it in items)
