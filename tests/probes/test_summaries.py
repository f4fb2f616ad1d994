"""probes.parts.common and the patching summary: intervals over items, Wilson proportions, the margin
rule stamped on records, the one-line reading, and the one line printed when nothing is usable."""

from __future__ import annotations

import dataclasses

import pytest

from kvnotes import tasks
from kvnotes.measure import metrics
from kvnotes.measure.metrics import bootstrap_ci
from kvnotes.models.registry import get_spec
from kvnotes.models.tiny import tiny_model
from probes import patching as locality
from probes.parts import common as _common
from runner.rundir import summary_table


def _rec(item: str, cond: str, value: float, **kw) -> dict:
    return {"item_id": item, "condition": cond, "recovery": value, "margin": 0.3, **kw}


def test_rows_of_one_item_are_averaged_before_the_interval():
    # item a: three draws (0, 0, 0.9) -> 0.3; item b: one row 0.9; over items 0.6, pooled rows 0.45
    recs = [_rec("a", "randomk", v) for v in (0.0, 0.0, 0.9)] + [_rec("b", "randomk", 0.9)]
    out = _common.by_condition(recs, ["randomk"])["randomk"]
    assert out["n"] == 2 and out["mean"] == pytest.approx(0.6)
    assert bootstrap_ci([0.0, 0.0, 0.9, 0.9])[0] == pytest.approx(0.45)  # what pooling would report
    curve = _common.curve(recs, "randomk", "condition")
    assert curve[0]["n"] == 2 and curve[0]["mean"] == pytest.approx(0.6)


def test_proportions_get_a_wilson_interval_never_zero_width():
    p = metrics.prop_dict([True] * 30)
    assert p["mean"] == 1.0 and p["ci_hi"] == 1.0 and p["ci_lo"] == pytest.approx(0.8865, abs=1e-4)
    assert p["k"] == 30 and p["n"] == 30 and p["interval"] == "wilson"
    with pytest.raises(ValueError, match="0/1"):
        metrics.prop_dict([0.5, 1.0])


def _summary(fo, no, fd, n=30):
    def ci(m, lo, hi):
        return {"mean": m, "ci_lo": lo, "ci_hi": hi, "n": n}
    return {"field_only": ci(*fo), "notes_only": ci(*no), "full_downstream": ci(*fd)}


def test_reading_names_the_picture_the_intervals_show():
    paper = locality.reading(_summary((0.02, -0.01, 0.05), (0.95, 0.9, 1.0), (1.0, 1.0, 1.0)), 30)
    assert "the paper's picture" in paper and "over 30 usable items" in paper and "0.02 [-0.01, 0.05]" in paper
    direct = locality.reading(_summary((0.9, 0.8, 1.0), (0.1, 0.0, 0.2), (1.0, 1.0, 1.0)), 30)
    assert "read from the field itself" in direct
    near = locality.reading(_summary((0.09, -0.1, 0.27), (0.92, 0.73, 1.11), (1.0, 1.0, 1.0)), 42)
    assert "carry most of the decision" in near and "at most a little (its CI reaches 0 and 0.27)" in near
    some = locality.reading(_summary((0.2, 0.05, 0.35), (0.8, 0.6, 0.9), (1.0, 1.0, 1.0)), 42)
    assert "the field's own K/V some" in some
    mixed = locality.reading(_summary((0.4, 0.2, 0.6), (0.6, 0.4, 0.8), (1.0, 1.0, 1.0)), 30)
    assert "both the field and the notes" in mixed
    assert locality.reading(_summary((0.4, 0.2, 0.6), (0.6, 0.4, 0.8), (1, 1, 1), n=0), 0) is None


def test_no_usable_item_prints_one_line_not_a_table_of_nan():
    recs = [{"item_id": f"i{i}", "condition": "skipped", "reason": "|score_new - score_old| = 0.1 < margin 1",
             "margin": 1.0, "score_stale": 0.0, "score_oracle": 0.1 * (i + 1), "margin_rule": "margin 1: by hand"}
            for i in range(4)]
    s = locality.summarize(recs, locality.PatchingConfig())
    assert s["n_usable"] == 0 and "none of 4" in s["no_usable"] and "0.4" in s["no_usable"]
    assert s["margin_rule"] == "margin 1: by hand" and "reading" not in s
    text = summary_table({"kind": "probe", "name": "patching", "model": "llama", **s})
    assert "nan" not in text and len(text.splitlines()) == 3 and text.splitlines()[-1] == s["no_usable"]


def test_summary_table_ends_with_reading_and_margin_rule():
    ci = {"mean": 0.5, "ci_lo": 0.25, "ci_hi": 0.75, "n": 8}
    text = summary_table({"kind": "probe", "name": "patching", "model": "m", "n_items": 8, "n_usable": 8,
                          "recovery": {"field_only": ci}, "reading": "R.", "margin_rule": "margin 0.3: derived"})
    assert text.splitlines()[-2:] == ["reading: R.", "margin rule: margin 0.3: derived"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_run_pairs_stamps_the_margin_rule_on_every_record(model):
    items = tasks.build_suite("gated", model.tokenizer, chat=False, n_items=2, length=700, seed=0)
    recs = locality.run(model, items, locality.PatchingConfig(margin=0.0, per_position=False, per_layer=False))
    assert recs and all(r["margin_rule"] == "set by the probe config (probe.margin=0)" for r in recs)
    s = locality.summarize(recs, locality.PatchingConfig())
    assert s["margin_rule"].startswith("set by the probe config") and s["reading"].startswith("over 2 usable")
    bare = locality.run(model, items[:1], locality.PatchingConfig(per_position=False, per_layer=False))
    assert bare[0]["margin_rule"].startswith("margin 1: set by hand (no derivation")  # a tiny model
    spec = get_spec("llama")  # as loaded: the registry's margin, derived by the rule
    as_llama = dataclasses.replace(model, spec=spec)
    rule = locality.run(as_llama, items[:1], locality.PatchingConfig(per_position=False, per_layer=False))[0]["margin_rule"]
    assert rule.startswith(f"margin {spec.margin:g}: derived") and "RMS" in rule
    by_hand = as_llama.with_margin(1.0)  # the run overrides the derived margin (model.margin=1)
    rule = locality.run(by_hand, items[:1], locality.PatchingConfig(per_position=False, per_layer=False))[0]["margin_rule"]
    assert rule.startswith("margin 1: set by hand")


def test_timings_are_a_min_max_range_and_the_table_calls_them_that():
    r = metrics.range_dict([2.0, 1.0, float("nan"), 4.0])
    assert (r["min"], r["max"], r["median"], r["n"], r["interval"]) == (1.0, 4.0, 2.0, 3, "min-max")
    assert "ci_lo" not in r
    text = summary_table({"kind": "experiment", "name": "edit", "model": "m", "n_items": 3,
                          "strategies": {"erratum": {"time_ratio": r, "p_correct": metrics.prop_dict([1, 1, 1])}}})
    assert "(min-max 1.000-4.000) n=3" in text and "nan" not in text


def test_edit_summary_uses_wilson_for_p_correct_and_a_range_for_time():
    from experiments.shared.edits import summarize_states

    rows = [{"item_id": f"i{i}", "strategy": "erratum", "usable_p_correct": True, "usable_recovery": True,
             "correct": True, "recovery": 1.0, "recompute_fraction": 0.1, "time_ratio": 0.2 + 0.01 * i,
             "margin": 0.03} for i in range(30)]
    s = summarize_states(rows)["strategies"]["erratum"]
    assert s["p_correct"]["ci_lo"] == pytest.approx(0.8865, abs=1e-4) and s["p_correct"]["ci_hi"] == 1.0
    assert s["time_ratio"]["interval"] == "min-max" and s["time_ratio"]["max"] == pytest.approx(0.49)


def test_patching_recovery_carries_a_domain_cluster_interval_beside_the_item_one():
    # 4 domains x 5 items; items of a domain alike: the domain bootstrap is the wider interval
    recs = [{"item_id": f"{d}/{i}", "domain": d, "condition": c, "recovery": v + 0.001 * i, "margin": 0.0}
            for d, v in zip("abcd", (0.0, 0.05, 0.2, 0.6), strict=True) for i in range(5)
            for c in ("field_only", "notes_only")]
    s = locality.summarize(recs, locality.PatchingConfig(n_boot=500))
    fo = s["recovery"]["field_only"]
    cl = fo["ci_cluster"]
    assert cl["cluster"] == "domain" and cl["n_clusters"] == 4 and cl["n"] == 20
    assert cl["ci_hi"] - cl["ci_lo"] > 1.5 * (fo["ci_hi"] - fo["ci_lo"])
    assert "ci_cluster" not in s["recovery"]["stale"]  # no rows: no interval
    assert "ci_cluster" not in summary_table({"kind": "probe", "name": "patching", "model": "m", **s})
