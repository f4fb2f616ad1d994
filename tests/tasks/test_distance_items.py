"""Distance items: the field moves, nothing else does; existing suites render byte-identically."""

from __future__ import annotations

import hashlib

import pytest

from kvnotes.tasks import build_suite, load_suite
from kvnotes.tasks.distance import SLACK, build_distance_item, build_distance_suite, min_distance
from kvnotes.tasks.tokens import check_alignment, frame

# sha256[:16] of five items per suite, taken before kvnotes.tasks.distance existed (commit a8f74d8).
# A change here means every earlier run's prompts changed: only ever on purpose, and then say so.
FROZEN = {
    ("qwen", "gated", 400): "32c5d42bffddcc75",
    ("qwen", "gated", 1500): "f5c3287c0379e597",
    ("qwen", "gated-control", 400): "dfde831d796fd71b",
    ("qwen", "gated-polarity", 400): "702622c1f7c2d476",
    ("qwen", "gated-trigger", 400): "89e81243af969221",
    ("gemma", "gated", 400): "67f740b1de9d9b89",
    ("gemma", "gated", 1500): "d56898cd5c9e538c",
    ("gemma", "gated-control", 400): "b7a25f552e1413eb",
    ("gemma", "gated-polarity", 400): "781da664eb69d8b0",
    ("gemma", "gated-trigger", 400): "8f58aab070c70252",
}
DISTANCES = [32, 64, 128, 256, 512, 1024]


def _hash(items) -> str:
    m = hashlib.sha256()
    for it in items:
        m.update(repr(sorted(it.to_dict().items())).encode())
    return m.hexdigest()[:16]


@pytest.mark.parametrize("key", sorted(FROZEN))
def test_existing_suites_render_byte_identically(key, qwen_tok, gemma_tok):
    tok_name, suite, length = key
    tok, chat = (qwen_tok, True) if tok_name == "qwen" else (gemma_tok, False)
    items = build_suite(suite, tok, chat=chat, n_items=5, length=length, seed=3)
    assert _hash(items) == FROZEN[key]


def test_distance_sweep_renders_for_every_tokenizer(named_tok):
    name, tok, chat = named_tok
    items = build_distance_suite("gated", tok, chat=chat, distances=DISTANCES, n_items=4, seed=1)
    assert len(items) == 4 * len(DISTANCES)
    for i in range(4):
        group = items[i * len(DISTANCES):(i + 1) * len(DISTANCES)]
        assert [it.meta["distance"] for it in group] == DISTANCES
        first = group[0]
        for it in group:
            check_alignment(it.old_ids, it.new_ids, it.field_span)
            d, got = it.meta["distance"], it.meta["distance_tokens"]
            assert got == it.n_tokens - it.field_span[1]
            assert d - 10 <= got <= d + SLACK, (name, d, got)
            # same draw at every distance: domain, values, rule, request, total length
            assert (it.domain, it.template_id, it.old_value, it.correct_new) == (
                first.domain, first.template_id, first.old_value, first.correct_new)
            assert abs(it.n_tokens - it.meta["length"]) <= 10 and it.meta["length"] == first.meta["length"]
            seg = it.segments
            # rule, demonstrations and request come before the field; after it only filler and the task
            assert seg["rule"][1] <= seg["examples"][0] < seg["request"][0] < it.field_span[0]
            assert seg["session"][1] == it.field_span[1] + 1  # the field is the session's last line
            after = {k for k, (s, e) in seg.items() if s >= it.field_span[1]}
            assert after <= {"policy_after", "task", "turn_answer", "answer_prefix"}, after
            assert it.old_text.rstrip().endswith("Next action:")
        # at the longest distance nothing but the fixed text precedes the session (length null)
        last = group[-1]
        assert last.segments["policy"][1] - last.segments["policy"][0] <= 5


def test_fresh_suite_also_sweeps(qwen_tok):
    items = build_distance_suite("gated-fresh", qwen_tok, distances=[64, 256], n_items=6, seed=0)
    assert {it.domain for it in items} == {d.name for d in load_suite("gated-fresh").domains}


def test_explicit_length_and_domain_subset(qwen_tok):
    items = build_distance_suite("gated", qwen_tok, distances=[40, 200], n_items=2, length=600,
                                 seed=0, domains=["visa", "loan"], design={"fewshot": 0})
    assert {it.domain for it in items} == {"visa", "loan"}
    assert all(abs(it.n_tokens - 600) <= 10 and "Examples:" not in it.old_text for it in items)


def test_bad_distances_and_lengths_fail_in_one_line(qwen_tok):
    s = load_suite("gated")
    fr = frame(qwen_tok, True)
    closing = min_distance(s, qwen_tok, fr, 0, 0)
    assert 20 < closing < 40
    with pytest.raises(ValueError, match=r"distance 8 is below the \d+ tokens .*use distances >="):
        build_distance_suite("gated", qwen_tok, distances=[8, 64], n_items=2)
    with pytest.raises(ValueError, match="length 100 is below"):
        build_distance_item(s, qwen_tok, fr, 0, 256, 100, 0)
    with pytest.raises(ValueError, match="distinct ints"):
        build_distance_suite("gated", qwen_tok, distances=[64, 64])
    with pytest.raises(ValueError, match="variant field"):
        build_distance_suite("gated-control", qwen_tok, distances=[64], n_items=1)
