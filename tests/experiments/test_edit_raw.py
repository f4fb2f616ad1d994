"""Uncalibrated P(correct) beside the calibrated one (issue 31 item 5): the raw argmax of a
two-outcome item is the sign of its score, read over the items usable without calibration."""

from __future__ import annotations

import math

import pytest

from experiments.shared.edits import summarize_states
from kvnotes.measure.metrics import raw_p_correct
from runner.table import summary_table

# item: (usable_recovery, usable_p_correct (calibrated), score_stale, score_oracle,
#        {strategy: (score, correct calibrated)})
ITEMS = {
    # usable both ways: the erratum decides new, field-only stays old
    "a": (True, True, -1.0, 2.0, {"erratum": (1.5, True), "field_only": (-0.8, False)}),
    # calibrated usable, raw not: without the offset the stale prompt already picks the new answer
    "b": (True, True, 0.5, 3.0, {"erratum": (2.0, True), "field_only": (0.7, True)}),
    # raw usable, calibrated not: the offset moves the oracle's pick to the old answer
    "c": (True, False, -2.0, 0.4, {"erratum": (0.3, False), "field_only": (-1.9, False)}),
    # below the margin: usable neither way
    "d": (False, False, -0.01, 0.005, {"erratum": (0.004, True), "field_only": (-0.01, False)}),
}


def _records() -> list[dict]:
    out = []
    for item, (u_rec, u_p, st, orc, states) in ITEMS.items():
        for strategy, (s, correct) in {"stale": (st, False), "oracle": (orc, True), **states}.items():
            out.append({"item_id": item, "strategy": strategy, "margin": 0.03, "usable_recovery": u_rec,
                        "usable_p_correct": u_p, "score": s, "score_stale": st, "score_oracle": orc,
                        "correct": correct, "recovery": (s - st) / (orc - st), "recompute_fraction": 0.1,
                        "time_ratio": 0.5})
    return out


def test_raw_p_correct_reads_the_sign_of_the_score():
    usable, correct = raw_p_correct([1.5, -0.8, 0.3, 0.0], [-1.0, -1.0, 0.5, -1.0], [2.0, 2.0, 3.0, 2.0],
                                    [True, True, True, False])
    assert usable.tolist() == [True, True, False, False]  # stale must pick old, oracle new, and the margin hold
    assert correct.tolist() == [True, False, True, False]  # a tie (score 0) picks neither answer


def test_the_edit_summary_gives_p_correct_raw_over_the_items_usable_uncalibrated():
    s = summarize_states(_records())
    assert s["n_usable_p_correct"] == 2 and s["n_usable_p_correct_raw"] == 2  # a, b calibrated; a, c raw
    st = s["strategies"]
    assert st["field_only"]["p_correct"]["mean"] == 0.5  # b decides new once calibrated
    raw = st["field_only"]["p_correct_raw"]
    assert (raw["mean"], raw["k"], raw["n"], raw["interval"]) == (0.0, 0, 2, "wilson") and raw["ci_hi"] > 0.5
    assert st["erratum"]["p_correct_raw"]["mean"] == 1.0 and st["erratum"]["p_correct_raw"]["n"] == 2
    assert st["stale"]["p_correct_raw"]["mean"] == 0.0 and st["oracle"]["p_correct_raw"]["mean"] == 1.0
    assert "n_usable_p_correct_raw=2" in summary_table({"kind": "experiment", "name": "edit", "model": "m", **s})


def test_records_without_scores_are_usable_for_no_raw_reading():
    rows = [{k: v for k, v in r.items() if not k.startswith("score")} for r in _records()]
    s = summarize_states(rows)
    assert s["n_usable_p_correct_raw"] == 0 and math.isnan(s["strategies"]["erratum"]["p_correct_raw"]["mean"])
    assert s["strategies"]["erratum"]["p_correct"]["mean"] == pytest.approx(1.0)
