"""kvnotes.edit.patching on tiny random models of every family, against plain transformers forwards.

References: the stale and oracle caches and scores are prefills of the old and new prompts; a
patched state is rebuilt by hand (the old prompt's K/V with the new prompt's at the chosen
positions and layers, as tensors) and the last prompt token run on it by the HF model itself.
Patching every position from the field start on is the new prompt (a re-prefill): recovery 1.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hf_reference import forward, prefill_kv
from tolerances import ATOL_FP32

from kvnotes.edit.patching import make_pair, patched_scores, recoveries, scores_from_logits
from kvnotes.tasks.item import TaskItem

N = 40  # prompt tokens: longer than the tiny sliding window (24)
POS_ID, NEG_ID = 5, 6  # decision tokens of the outcomes "b" (new-correct) and "a" (old-correct)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


def item(span: tuple[int, int] = (10, 13), seed: int = 0, n: int = N) -> TaskItem:
    """A synthetic token-aligned pair: random ids, the field `span` replaced in the new prompt."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(7, 128, (n,), generator=g).tolist()
    new = list(old)
    new[span[0]:span[1]] = [(t + 50) % 121 + 7 for t in old[span[0]:span[1]]]  # differs everywhere
    return TaskItem(
        item_id=f"synthetic-{seed}", suite="test", domain="test", template_id="t0", seed=seed,
        variant="field", field_name="x", old_value="o", new_value="n", old_text="", new_text="",
        old_ids=tuple(old), new_ids=tuple(new), field_span=span, aggregators=(), outcomes=("a", "b"),
        decision_ids=(NEG_ID, POS_ID), correct_old="a", correct_new="b",
    )


def hf_score(model, ids) -> float:
    """Decision score of a prompt from one plain HF forward (no cache)."""
    logits, _ = forward(model, None, list(ids), 0)
    return float(logits[-1, POS_ID] - logits[-1, NEG_ID])


def hand_patched_score(model, it: TaskItem, positions, layers=None) -> float:
    """The old prompt's K/V (HF prefill of ids[:-1]) with the new prompt's at `positions` of
    `layers` (None: all), written by index; then the HF model runs the last token on it."""
    old, new = prefill_kv(model, list(it.old_ids[:-1])), prefill_kv(model, list(it.new_ids[:-1]))
    idx = torch.tensor(list(positions), dtype=torch.long)
    mixed = []
    for layer, ((ko, vo), (kn, vn)) in enumerate(zip(old, new)):
        k, v = ko.clone(), vo.clone()
        if layers is None or layer in layers:
            k[:, :, idx], v[:, :, idx] = kn[:, :, idx], vn[:, :, idx]  # [1, kv_head, m, d_head]
        mixed.append((k, v))
    logits, _ = forward(model, mixed, [it.old_ids[-1]], it.n_tokens - 1)
    return float(logits[-1, POS_ID] - logits[-1, NEG_ID])


@pytest.mark.parametrize("span", [(10, 13), (0, 3)])  # shared prefix, and none (field first)
def test_make_pair_is_two_prefills_and_their_scores(tiny, span):
    it = item(span)
    pair = make_pair(tiny, it)
    n = N - 1
    assert pair.n_cached == n and pair.tail.tolist() == [[it.old_ids[-1]]]
    for cache, ids in ((pair.old, it.old_ids), (pair.new, it.new_ids)):
        ref = prefill_kv(tiny, list(ids[:-1]))
        assert cache.seq_len == n and cache.batch == 1
        for layer, (k, v) in enumerate(ref):
            assert (cache.keys[layer] - k).abs().max().item() <= ATOL_FP32
            assert (cache.values[layer] - v).abs().max().item() <= ATOL_FP32
    stale, oracle = hf_score(tiny, it.old_ids), hf_score(tiny, it.new_ids)
    assert pair.score_stale == pytest.approx(stale, abs=ATOL_FP32)
    assert pair.score_oracle == pytest.approx(oracle, abs=ATOL_FP32)
    assert pair.delta == pytest.approx(oracle - stale, abs=2 * ATOL_FP32)
    assert abs(pair.delta) > 100 * ATOL_FP32  # the field changes the decision: a usable item
    s, e = span
    assert pair.field_positions == list(range(s, e))
    assert pair.downstream_positions == list(range(e, n))
    assert pair.field_to_end == list(range(s, n))


def test_make_pair_refuses_a_field_that_reaches_the_decision_token(tiny):
    with pytest.raises(ValueError, match="before the decision token"):
        make_pair(tiny, item(span=(N - 3, N)))


def test_patched_scores_against_hand_built_caches(tiny):
    it = item()
    pair = make_pair(tiny, it)
    n = pair.n_cached
    partial = pair.field_to_end[::2]  # half the field and every other note position after it
    states = [[], list(range(n)), pair.field_to_end, list(range(5, n)), partial, partial]
    layers = [None, None, None, None, None, [1, 3]]
    got = patched_scores(tiny, pair, states, layers, batch_size=4)
    assert got.shape == (len(states),) and got.dtype == np.float64
    stale, oracle = hf_score(tiny, it.old_ids), hf_score(tiny, it.new_ids)
    # nothing patched: the old prompt; every position from the field start on: the new prompt
    assert got[0] == pytest.approx(stale, abs=ATOL_FP32)
    for i in (1, 2, 3):
        assert got[i] == pytest.approx(oracle, abs=ATOL_FP32)
    # a partial set (all layers, then layers 1 and 3 only) is neither: rebuilt by hand
    for i in (4, 5):
        want = hand_patched_score(tiny, it, states[i], layers[i])
        assert got[i] == pytest.approx(want, abs=ATOL_FP32)
    assert min(abs(got[4] - stale), abs(got[4] - oracle)) > 10 * ATOL_FP32  # not a trivial state
    assert abs(got[4] - got[5]) > 10 * ATOL_FP32  # the layers are honoured


def test_patching_only_the_field_leaves_the_stale_notes(tiny):
    """The field's K/V alone from the new prompt is not the new prompt: downstream positions
    still hold what they computed from the old field (the memoized notes)."""
    it = item()
    pair = make_pair(tiny, it)
    got = patched_scores(tiny, pair, [pair.field_positions])[0]
    assert got == pytest.approx(hand_patched_score(tiny, it, pair.field_positions), abs=ATOL_FP32)
    assert abs(got - pair.score_oracle) > 10 * ATOL_FP32


def test_recoveries_are_zero_for_stale_one_for_oracle_and_linear_between(tiny):
    pair = make_pair(tiny, item())
    scores = patched_scores(tiny, pair, [[], pair.field_to_end, pair.field_to_end[::2]])
    rec = recoveries(pair, scores)
    assert rec.shape == (3,)
    assert rec[0] == pytest.approx(0.0, abs=1e-3) and rec[1] == pytest.approx(1.0, abs=1e-3)
    stale, oracle = pair.score_stale, pair.score_oracle
    assert rec[2] == pytest.approx((scores[2] - stale) / (oracle - stale), rel=1e-9)
    # hand-made scores: exact values, a scalar gives a 1-d array, no denominator gives NaN
    mid = stale + 0.25 * (oracle - stale)
    assert recoveries(pair, np.array([stale, oracle, mid])).tolist() == pytest.approx([0.0, 1.0, 0.25])
    assert recoveries(pair, np.float64(oracle)).shape == (1,)
    flat = dataclasses.replace(pair, score_oracle=stale + 1e-6)
    assert math.isnan(recoveries(flat, np.array([stale]))[0])
    assert recoveries(flat, np.array([stale]), min_denominator=1e-7)[0] == pytest.approx(0.0)


def test_scores_from_logits_is_new_correct_minus_old_correct():
    it = item()
    logits = torch.zeros(2, 16)
    logits[0, POS_ID], logits[0, NEG_ID] = 3.0, 1.0
    logits[1, POS_ID], logits[1, NEG_ID] = -1.0, 0.5
    assert scores_from_logits(it.metric, logits).tolist() == [2.0, -1.5]
    control = dataclasses.replace(it, correct_new="a")  # no flip: "b" against the correct "a"
    assert control.score_ids == (POS_ID, NEG_ID)
