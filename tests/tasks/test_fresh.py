"""The fresh suite: six gated domains sharing no field, value, tool word or request with the 12
tuned ones, kept out of `gated`, rendering token-aligned under every packaged tokenizer."""

from __future__ import annotations

import re

from kvnotes.tasks import build_suite, domain_names, load_suite
from kvnotes.tasks.domains import builtin_domains
from kvnotes.tasks.tokens import check_alignment, encode

FRESH = "gated-fresh"


def _strings(domains, what: str) -> set[str]:
    out: set[str] = set()
    for d in domains:
        if what == "tools":
            out |= set(d.outcomes) | set(d.distractors)
        elif what in ("values", "requests"):
            out |= set(getattr(d, what))
        else:
            out.add(getattr(d, what))
    return out


def test_fresh_domains_share_nothing_with_the_tuned_twelve():
    fresh = load_suite(FRESH).domains
    tuned = builtin_domains().values()
    assert len(fresh) == 6 and len(tuned) == 12
    assert not {d.name for d in fresh} & set(domain_names())
    for what in ("field", "values", "tools", "requests", "role"):
        shared = _strings(fresh, what) & _strings(tuned, what)
        assert not shared, (what, shared)
    # not even a tool word (lend, hand, ...) of a tuned outcome or distractor
    tuned_words = {w for t in _strings(tuned, "tools") for w in t.split("_")}
    fresh_words = {w for t in _strings(fresh, "tools") for w in t.split("_")}
    assert not tuned_words & fresh_words, tuned_words & fresh_words


def test_fresh_domains_stay_out_of_the_other_suites():
    fresh = {d.name for d in load_suite(FRESH).domains}
    for suite in ("gated", "gated-control", "gated-polarity", "gated-trigger"):
        assert not fresh & {d.name for d in load_suite(suite).domains}, suite


def test_fresh_rules_name_the_field_and_state_both_cases():
    for d in load_suite(FRESH).domains:
        assert d.rules, d.name
        for rule in d.rules:
            slots = re.findall(r"{(\w+)}", rule)
            assert slots.count("field") >= 1 and {"v0", "v1", "o0", "o1"} <= set(slots), (d.name, rule)


def test_fresh_items_render_token_aligned_for_every_tokenizer(named_tok):
    name, tok, chat = named_tok
    suite = load_suite(FRESH)
    for d in suite.domains:  # values: same token count, so neither is padded
        a, b = (encode(tok, " " + v) for v in d.values)
        assert len(a) == len(b), (name, d.name, d.values)
    items = build_suite(FRESH, tok, chat=chat, n_items=12, seed=2)  # every domain, both old values
    assert {it.domain for it in items} == {d.name for d in suite.domains}
    assert {(it.domain, it.old_value) for it in items} == {(d.name, v) for d in suite.domains for v in d.values}
    for it in items:
        check_alignment(it.old_ids, it.new_ids, it.field_span)
        assert it.old_text.rstrip().endswith("Next action:")
        assert it.correct_old != it.correct_new and len(set(it.decision_ids)) == 2
        dom = next(d for d in suite.domains if d.name == it.domain)
        assert f"Check {dom.field} in the session" in it.old_text  # the task line names the field
        s, e = it.field_span
        assert tok.decode(list(it.new_ids[s:e])).strip() == it.new_value
