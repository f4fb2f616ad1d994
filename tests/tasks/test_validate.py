"""Usability gate and summaries (pure), scoring against plain forwards (tiny model)."""

from __future__ import annotations

import math

import pytest
import torch

from kvnotes.engine.run import full_logits
from kvnotes.tasks import build_suite, score_items, select_usable, summarize
from kvnotes.tasks.scoring import ItemScore
from kvnotes.tasks.validate import record, usable_ids


@pytest.fixture(scope="module")
def items(qwen_tok):
    return build_suite("gated", qwen_tok, n_items=4, length=300)


def _score(it, lo, ln, cf=None):
    """An ItemScore with the given outcome logits (old / new), in outcome order."""
    pos, neg = it.index(it.correct_new), it.index(it.correct_old)
    return ItemScore(it.item_id, it.outcomes, tuple(lo), tuple(ln), lo[pos] - lo[neg], ln[pos] - ln[neg],
                     None if cf is None else tuple(cf))


def _logits_for(it, winner_old, winner_new, gap):
    lo = [0.0, 0.0]
    ln = [0.0, 0.0]
    lo[it.index(winner_old)] = gap
    ln[it.index(winner_new)] = gap
    return lo, ln


def test_usability_reasons(items):
    it = items[0]
    good = record(it, _score(it, *_logits_for(it, it.correct_old, it.correct_new, 2.0)), 1.0)
    assert good["usable_recovery"] and good["usable_correct"] and good["flipped"]
    assert good["abs_delta"] == pytest.approx(4.0)
    small = record(it, _score(it, *_logits_for(it, it.correct_old, it.correct_new, 0.4)), 1.0)
    assert not small["usable_recovery"] and small["skip_recovery"] == "small_delta"
    assert small["skip_correct"] == "small_delta"
    # shifts by >= margin but argmax stuck on one outcome: usable for recovery, not P(correct)
    lo = [0.0, 0.0]
    ln = [0.0, 0.0]
    lo[it.index(it.correct_old)] = 3.0
    ln[it.index(it.correct_old)] = 1.5
    stuck = record(it, _score(it, lo, ln), 1.0)
    assert stuck["usable_recovery"] and not stuck["usable_correct"]
    assert stuck["skip_correct"] == "wrong_new"
    nan = record(it, _score(it, [math.nan, 0.0], [0.0, 0.0]), 1.0)
    assert not nan["usable_recovery"]
    # the same stuck item, calibrated against a content-free prompt that prefers correct_old
    cf = [0.0, 0.0]
    cf[it.index(it.correct_old)] = 2.25
    cal = record(it, _score(it, lo, ln, cf), 1.0)
    assert cal["readout"] == "calibrated" and cal["usable_correct"] and cal["flipped"]
    assert not cal["raw_flipped"] and cal["raw_acc_old"] and not cal["raw_acc_new"]
    assert not record(it, _score(it, lo, ln, cf), 1.0, calibrated=False)["usable_correct"]


def test_summary_reports_margin_skips_and_domains(items):
    recs = [record(it, _score(it, *_logits_for(it, it.correct_old, it.correct_new, g)), 1.0)
            for it, g in zip(items, [2.0, 0.1, 2.0, 0.2], strict=True)]
    s = summarize(recs)
    assert s["n_items"] == 4 and s["n_usable"] == 2 and s["margin"] == 1.0
    assert s["skipped_recovery"] == {"small_delta": 2}
    for d in s["per_domain"].values():
        assert {"accuracy_old", "accuracy_new", "flip_rate", "mean_abs_delta", "n_usable"} <= set(d)
    ids = usable_ids(recs)
    sel = select_usable(items, ids, "recovery")
    assert len(sel.items) == 2 and sel.skipped == {"not_usable": 2} and sel.margin == 1.0
    sel2 = select_usable(items, recs, "correct")
    assert sel2.report()["n_used"] == 2 and sel2.skipped == {"small_delta": 2}


def test_score_items_matches_a_plain_forward(qwen_tok):
    """Prefix-shared batched scoring == full forward of each prompt (tiny random qwen2)."""
    from kvnotes.models.tiny import tiny_model

    m = tiny_model("qwen2", seed=0)
    # real prompts, ids folded into the tiny vocabulary
    its = build_suite("gated", qwen_tok, n_items=2, length=300)
    V = m.hf.config.vocab_size
    from dataclasses import replace

    small = []
    for it in its:
        s, e = it.field_span
        old = tuple(i % V for i in it.old_ids)
        new = list(old)
        new[s:e] = [(i + 1) % V for i in old[s:e]]
        cf = list(old)
        cf[s:e] = [(i + 2) % V for i in old[s:e]]
        dec = tuple(range(len(it.outcomes)))
        small.append(replace(it, old_ids=old, new_ids=tuple(new), cf_ids=tuple(cf), decision_ids=dec))
    got = score_items(m, small)
    for it, sc in zip(small, got, strict=True):
        for ids, logits in ((it.old_ids, sc.logits_old), (it.new_ids, sc.logits_new),
                            (it.cf_ids, sc.logits_cf)):
            ref = full_logits(m, torch.tensor(ids))[0, -1]
            assert logits == pytest.approx([float(ref[i]) for i in it.decision_ids], abs=1e-4)
    assert score_items(m, small[:1], calibrate=False)[0].logits_cf is None
