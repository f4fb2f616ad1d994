"""Probe knockout's readouts: the signed reversion distribution, the distance-matched control, the
rule that decides which variant reproduces "the decision reverts", and identities on a tiny model."""

import math
import random

import numpy as np
import pytest

from kvnotes import tasks
from kvnotes.models.tiny import tiny_model
from probes import knockout
from probes.parts.readouts import (
    decision_shares,
    paired_difference,
    per_item,
    proportion,
    reversion_stats,
)


def test_reversion_stats_separate_reverting_from_overshooting_and_moving_away():
    s = reversion_stats([1.0, 0.7, 2.5, -0.3, 1.5, 0.5, float("nan"), 3.0])
    assert s["n"] == 7 and s["median"] == pytest.approx(1.0)
    assert (s["share_reverted"]["k"], s["share_overshoot"]["k"], s["share_away"]["k"]) == (4, 2, 1)
    assert s["share_reverted"]["mean"] == pytest.approx(4 / 7)
    assert s["share_reverted"]["ci_lo"] < 4 / 7 < s["share_reverted"]["ci_hi"]
    full = proportion([True] * 30)
    assert full["mean"] == 1.0 and full["ci_lo"] < 0.9  # Wilson: never zero width at 30/30


def test_random_draws_are_averaged_per_item_before_the_interval():
    recs = [{"item_id": i, "condition": "r", "reversion": v} for i, vals in (("a", (0.0, 1.0)), ("b", (2.0, 2.0)))
            for v in vals]
    means = per_item(recs, lambda r: r["condition"] == "r", "reversion")
    assert means == {"a": 0.5, "b": 2.0}
    d = paired_difference({"a": 1.0, "b": 3.0, "c": 9.0}, means)
    assert d["n"] == 2 and d["mean"] == pytest.approx(0.75)


def test_matched_random_keeps_count_and_distance():
    down = list(range(100, 400))
    top = [150, 151, 260, 380, 381, 390]
    keys = knockout.matched_random(top, down, 400, random.Random(0), width=3)
    assert len(keys) == len(top) and not set(keys) & set(top) and set(keys) <= set(down)
    assert np.abs(np.sort(keys) - np.sort(top)).max() <= 4  # each partner among the 3 nearest free
    assert keys == knockout.matched_random(top, down, 400, random.Random(0), width=3)  # seeded
    with pytest.raises(ValueError, match="to match"):
        knockout.matched_random(down[:200], down, 400, random.Random(0), width=3)


@pytest.mark.parametrize(("top", "diff_lo", "expected"), [
    ([1.0, 0.9, 1.2, 0.8, 1.1], 0.3, True),
    ([2.5, 3.0, 2.2, 1.0, 0.9], 0.3, False),  # overshoots: median above 1.5
    ([1.0, 0.9, 1.2, 0.8, 1.1], -0.1, False),  # no better than matched random keys
    ([1.0, 0.9, -1.0, 3.0, 2.0], 0.3, False),  # median in band but fewer than half revert
])
def test_the_reverts_rule(top, diff_lo, expected):
    assert knockout.reproduces(reversion_stats(top), {"ci_lo": diff_lo}) is expected


def test_the_reverts_rule_says_nothing_without_items():
    assert knockout.reproduces(reversion_stats([]), {"ci_lo": float("nan")}) is None


def _row(item, domain, score, rev, stale=-1.0, oracle=1.0, **kw):
    return {"item_id": item, "domain": domain, "score": score, "reversion": rev, "score_stale": stale,
            "score_oracle": oracle, **kw}


def test_decisions_count_flips_overshoot_and_away_as_decisions():
    rows = [_row("a", "d1", -0.5, 0.75), _row("b", "d1", -3.0, 2.0),  # back to the old answer (b overshoots)
            _row("c", "d2", 0.5, 0.25), _row("d", "d2", 2.0, -0.5),  # stays new; d moves away
            _row("e", "d3", -1.0, 0.9, stale=0.5, oracle=2.0),  # raw: both prompts decide new, no flip to read
            _row("f", "d3", 0.0, 0.6), _row("f", "d3", -2.0, 1.4)]  # two draws: averaged score -1.0, r 1.0
    d = decision_shares(rows)
    assert (d["flip"]["k"], d["flip"]["n"]) == (3, 5) and d["flip"]["readout"] == "raw"
    assert (d["reached_half"]["k"], d["reached_half"]["n"]) == (4, 6)  # r >= 0.5, overshoot included
    assert (d["away"]["k"], d["away"]["n"]) == (1, 6)
    assert d["flip"]["ci_cluster"]["cluster"] == "domain" and d["flip"]["ci_cluster"]["n_clusters"] == 3
    f, c = d["flip"], d["flip"]["ci_cluster"]
    widest = max([[f["ci_lo"], f["ci_hi"]], [c["ci_lo"], c["ci_hi"]]], key=lambda x: x[1] - x[0])
    assert d["flip"]["verdict_ci"] == widest
    assert d["quantiles"]["0.5"] == pytest.approx(0.825) and sum(d["histogram"]["counts"]) == 6
    assert d["flip_calibrated"]["n"] == 0 and "score_cf" in d["flip_calibrated"]["why"]
    # with the content-free score, item e decides old under the stale prompt (0.5 - 1 < 0) and goes back
    cal = decision_shares([r | {"score_cf": 1.0 if r["item_id"] == "e" else 0.0} for r in rows])
    assert (cal["flip_calibrated"]["k"], cal["flip_calibrated"]["n"]) == (4, 6)


@pytest.mark.parametrize(("flip", "rand", "expected"), [
    ({"n": 32, "verdict_ci": [0.35, 0.70]}, {"n": 32, "verdict_ci": [0.0, 0.11]}, True),
    ({"n": 32, "verdict_ci": [0.10, 0.40]}, {"n": 32, "verdict_ci": [0.0, 0.11]}, False),  # intervals overlap
    ({"n": 0, "verdict_ci": [math.nan, math.nan]}, {"n": 32, "verdict_ci": [0.0, 0.11]}, None),
])
def test_the_flip_rule(flip, rand, expected):
    assert knockout.flips_reproduce(flip, rand) is expected


def test_config_errors_name_what_is_valid():
    with pytest.raises(ValueError, match="after_notes"):
        knockout.KnockoutConfig(variants=["everything"])
    with pytest.raises(ValueError, match="matched control"):
        knockout.KnockoutConfig(top_fraction=0.8)


@pytest.fixture(scope="module")
def records(one_thread):
    model = tiny_model("llama")
    items = tasks.build_suite("gated", model.tokenizer, chat=False, n_items=2, length=700, seed=0)
    n_all = model.n_layers * model.adapter.n_heads(model.hf)
    cfg = knockout.KnockoutConfig(margin=0.0, n_random=2, n_random_dose=2, fractions=[0.1, 0.25, 1.0],
                                  head_ks=[1, 2, n_all, 10_000])
    return model, cfg, knockout.run(model, items, cfg)


def _one(recs, **eq):
    rows = [r for r in recs if all(r.get(k) == v for k, v in eq.items())]
    return rows


def test_same_key_sets_give_the_same_reading(records):
    _, _, recs = records
    for item in {r["item_id"] for r in recs}:
        for variant in ("decision", "after_notes"):
            top = _one(recs, item_id=item, variant=variant, condition="top")[0]
            dose = _one(recs, item_id=item, variant=variant, condition="dose", fraction=0.25)[0]
            assert dose["score"] == pytest.approx(top["score"], abs=1e-5)  # the top set is the 25 % dose
            everything = _one(recs, item_id=item, variant=variant, condition="dose", fraction=1.0)[0]
            for r in _one(recs, item_id=item, variant=variant, condition="dose_random", fraction=1.0):
                assert r["score"] == pytest.approx(everything["score"], abs=1e-5)
        all_band = _one(recs, item_id=item, condition="band", band="all")[0]
        top = _one(recs, item_id=item, variant="decision", condition="top")[0]
        assert all_band["score"] == pytest.approx(top["score"], abs=1e-5)


def test_head_curves_end_at_the_new_run_and_start_at_the_best_head(records):
    model, cfg, recs = records
    n_all = model.n_layers * model.adapter.n_heads(model.hf)
    for item in {r["item_id"] for r in recs}:
        single = [r["recovery"] for r in _one(recs, item_id=item, condition="head_single")]
        assert len(single) == n_all
        if all(math.isnan(x) for x in single):
            continue  # |oracle - stale| ~ 0 on this item: no recovery to check
        best = _one(recs, item_id=item, condition="heads", ranking="effect", n_heads=1)[0]
        assert best["recovery"] == pytest.approx(max(single), abs=1e-6)
        every = _one(recs, item_id=item, condition="heads", ranking="attention")
        assert {r["n_heads"] for r in every} == {1, 2, 12, n_all}  # 10_000 > all heads: dropped; 12 added
        full = _one(recs, item_id=item, condition="heads", ranking="random", n_heads=n_all)
        assert [r["recovery"] for r in full] == pytest.approx([1.0] * 2, abs=1e-4)  # every head: the new run
    s = knockout.summarize(recs, cfg)
    random_12 = next(p for p in s["heads"]["curves"]["random"] if p["n_heads"] == 12)
    assert random_12["n"] <= 2  # items, not draws
    assert s["decision"]["random_matched"]["n"] <= 2 and "top_minus_random" in s["after_notes"]
    who = ", ".join(s["flip_reproduced_by"]) or "neither variant"
    assert s["reading"].startswith("top 25 % most-attended keys masked") and f"reproduced by {who}" in s["reading"]


def test_records_carry_the_content_free_score_and_the_summary_reads_flips(records):
    _, cfg, recs = records
    tops = [r for r in recs if r.get("condition") == "top"]
    assert tops and all(math.isfinite(r["score_cf"]) for r in tops)  # gated items have a content-free prompt
    s = knockout.summarize(recs, cfg)
    for v in ("decision", "after_notes"):
        for key in ("flip_share", "flip_share_random", "flip_share_calibrated"):
            assert {"k", "n", "verdict_ci", "ci_cluster"} <= set(s[v][key]) or s[v][key]["n"] == 0
        assert {"quantiles", "histogram", "reached_half", "away"} <= set(s[v]["decisions"]["top"])
        assert s[v]["flip_share"]["readout"] == "raw" and "share_reverted" in s[v]["top"]  # old keys stay
    assert "flip_share" in s["bands"][0] and "matched random" in s["flip_rule"]
