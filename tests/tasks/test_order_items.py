"""Order items: 12 cells of one draw differ only in field/rule order, stretch content and length."""

from __future__ import annotations

import pytest

from kvnotes.tasks import load_suite
from kvnotes.tasks.order import SLACK, build_order_items, build_order_suite, cells, check_stretches
from kvnotes.tasks.tokens import check_alignment, frame

STRETCHES = [64, 256, 1024]
SHARED = ("session", "rule", "examples", "request")  # token-identical in every cell


def _ids(it, seg: str) -> tuple[int, ...]:
    a, b = it.segments[seg]
    return tuple(it.old_ids[a:b])


@pytest.fixture(scope="module", params=["qwen", "gemma"])
def groups(request, qwen_tok, gemma_tok):
    tok, chat = (qwen_tok, True) if request.param == "qwen" else (gemma_tok, False)
    items = build_order_suite("gated", tok, chat=chat, stretches=STRETCHES, n_items=3, seed=2)
    return [items[i * 12:(i + 1) * 12] for i in range(3)]


def test_twelve_cells_share_field_values_rule_and_request(groups):
    for group in groups:
        assert [it.meta["order"] + "/" + it.meta["content"] + "/" + str(it.meta["stretch"]) for it in group] == [
            c.key for c in cells(STRETCHES)]
        first = group[0]
        for it in group:
            check_alignment(it.old_ids, it.new_ids, it.field_span)
            s, e = it.field_span
            f0, e0 = first.field_span
            assert (it.old_ids[s:e], it.new_ids[s:e]) == (first.old_ids[f0:e0], first.new_ids[f0:e0])
            assert all(_ids(it, seg) == _ids(first, seg) for seg in SHARED)
            assert (it.domain, it.template_id, it.old_value, it.new_value, it.correct_old, it.correct_new) == (
                first.domain, first.template_id, first.old_value, first.new_value, first.correct_old,
                first.correct_new)


def test_stretch_lengths_are_within_tolerance(groups):
    for group in groups:
        for it in group:
            m = it.meta
            assert m["stretch_tokens"] == it.segments["task"][0] - m["later_end"]
            assert m["stretch"] - SLACK <= m["stretch_tokens"] <= m["stretch"], m
            assert m["distance_tokens"] == it.n_tokens - m["later_end"]
        for s in STRETCHES:  # cells of one stretch: one total length, within a filler line
            n = [it.n_tokens for it in group if it.meta["stretch"] == s]
            assert max(n) - min(n) <= SLACK, (s, n)


def test_order_and_content_placement(groups):
    for group in groups:
        for it in group:
            m, seg = it.meta, it.segments
            (rs, re_), (ss, se), task = seg["rule"], seg["session"], seg["task"][0]
            if m["order"] == "field_before_rule":
                assert it.field_span[1] < rs and m["later_end"] == re_
            else:
                assert re_ < it.field_span[0] and m["later_end"] == se == it.field_span[1] + 1
            content = [seg["examples"], seg["request"]]
            if m["content"] == "task":  # both between the later of field and rule and the task line
                assert all(m["later_end"] <= a and b <= task for a, b in content)
                assert seg["request"][1] == task  # content_at end: next to the task line
            else:  # before both; the stretch holds filler only
                assert all(b <= min(rs, ss) for _, b in content)
                assert seg["stretch"][0] > m["later_end"] and seg["stretch"][1] == task


def test_content_at_start_and_equal_length(qwen_tok):
    s, fr = load_suite("gated"), frame(qwen_tok, True)
    group = build_order_items(s, qwen_tok, fr, 0, STRETCHES, 0, place="start", equal_length=True)
    assert max(it.n_tokens for it in group) - min(it.n_tokens for it in group) <= SLACK
    for it in group:
        if it.meta["content"] == "task":
            assert it.segments["examples"][0] == it.meta["later_end"] + 1  # after the blank line
            assert it.segments["stretch"][1] == it.segments["task"][0]


def test_bad_input_raises_one_line(qwen_tok):
    with pytest.raises(ValueError, match="stretch 16 is below the"):
        build_order_suite("gated", qwen_tok, stretches=[16, 256], n_items=1)
    with pytest.raises(ValueError, match="variant field"):
        build_order_suite("gated-control", qwen_tok, n_items=1)
    for bad in ([], [64, 64], [0], [64, 9000], [64.5]):
        with pytest.raises(ValueError, match="stretches must be"):
            check_stretches(bad)
