"""analysis.heads_section: the four head rankings side by side, from each run's summary."""

import json

import pandas as pd

from analysis.heads_section import heads_section


def _ci(mean, n=40):
    return {"mean": mean, "ci_lo": mean - 0.05, "ci_hi": mean + 0.05, "n": n}


def test_one_row_per_k_and_the_paired_differences(tmp_path):
    curves = {rk: [{"n_heads": k, **_ci(v * k)} for k in (1, 12)]
              for rk, v in (("attention", 0.01), ("effect", 0.08), ("effect_heldout", 0.05), ("random", 0.0))}
    s = {"n_curve_items": 40, "margin": 0.03, "heads": {"curves": curves},
         "heldout_minus_attention_k12": _ci(0.48), "effect_minus_heldout_k12": _ci(0.36)}
    (tmp_path / "summary.json").write_text(json.dumps(s))
    frame = pd.DataFrame([{"job": "heads_heldout", "model": "qwen-1.5b", "run_id": "heads_heldout/q/1",
                           "run_path": str(tmp_path)}])
    text = "\n".join(heads_section(frame))
    assert "| k | attention to the notes | effect on the other items (held out) |" in text
    assert "| 12 | 0.120 [0.070, 0.170] | 0.600 [0.550, 0.650] | 0.960 [0.910, 1.010] | 0.000 [-0.050, 0.050] |" in text
    assert "heldout minus attention at k = 12: 0.480 [0.430, 0.530]" in text
    assert "the shortfall of the attention ranking is the ranking" in text  # CI of the gap above 0
    assert "part of its curve is fit to the item" in text
    assert "overshoot" not in text  # every curve at k = 12 stays below 1
    assert heads_section(pd.DataFrame([{"job": "knockout", "model": "q", "run_id": "k/1", "run_path": "."}])) == []


def test_the_reading_follows_the_intervals_not_the_means():
    from analysis.heads_section import reading

    both = {"heldout_minus_attention_k12": _ci(0.03), "effect_minus_heldout_k12": _ci(0.02)}  # CIs straddle 0
    text = reading(both)
    assert "cannot be told apart" in text and "adds nothing" in text
    assert reading({}) == ""


def test_a_curve_above_one_is_called_an_overshoot():
    from analysis.heads_section import reading

    s = {"heads": {"curves": {"effect": [{"n_heads": 12, **_ci(2.0)}], "attention": [{"n_heads": 12, **_ci(0.3)}]}},
         "heldout_minus_attention_k12": _ci(0.5), "effect_minus_heldout_k12": _ci(1.0)}
    assert "Above 1 at k = 12 (effect on the item itself (in sample)): " in reading(s)


def test_a_newer_frozen_transfer_run_does_not_replace_the_cross_fitted_one(tmp_path):
    crossed, frozen = tmp_path / "crossed", tmp_path / "frozen"
    for d in (crossed, frozen):
        d.mkdir()
    curves = {rk: [{"n_heads": 12, **_ci(v)}] for rk, v in (("attention", 0.3), ("effect_heldout", 0.8))}
    (crossed / "summary.json").write_text(json.dumps({"n_curve_items": 40, "heads": {"curves": curves}}))
    (frozen / "summary.json").write_text(json.dumps({  # no held-out curve: frozen heads on another suite
        "n_curve_items": 30, "frozen": {"source_run": ["heads_heldout/qwen-1.5b/1"]},
        "heads": {"curves": {"frozen_effect": [{"n_heads": 12, **_ci(0.7)}]}}}))
    frame = pd.DataFrame([{"job": "heads_heldout", "model": "qwen-1.5b", "run_id": f"heads_heldout/q/{i}",
                           "run_path": str(d)} for i, d in ((1, crossed), (2, frozen))])
    text = "\n".join(heads_section(frame))
    assert "40 items" in text and "effect on the other items (held out)" in text
    assert "heads_heldout/q/2" not in text


def test_frozen_transfer_runs_get_their_own_table_with_both_intervals(tmp_path):
    crossed, fresh = tmp_path / "crossed", tmp_path / "fresh"
    for d in (crossed, fresh):
        d.mkdir()
    (crossed / "summary.json").write_text(json.dumps(
        {"n_curve_items": 40, "heads": {"curves": {"attention": [{"n_heads": 12, **_ci(0.3)}]}}}))
    cells = {rk: _ci(v, 48) | {"ci_cluster": {"cluster": "domain", "ci_lo": v - 0.2, "ci_hi": v + 0.1}}
             for rk, v in (("frozen_effect", 0.73), ("attention", 0.19), ("random", 0.03))}
    (fresh / "summary.json").write_text(json.dumps({
        "n_usable": 48, "recovery_k12": cells,
        "frozen": {"source_run": ["heads_heldout/qwen-1.5b/1"], "n_heads": 12}}))
    frame = pd.DataFrame([{"job": "heads_heldout", "model": "qwen-1.5b", "run_id": f"heads_heldout/q/{i}",
                           "task": t, "run_path": str(d)} for i, t, d in ((1, "gated", crossed), (2, "gated-fresh", fresh))])
    text = "\n".join(heads_section(frame))
    assert "### Frozen read heads on other suites" in text
    assert ("| qwen-1.5b (Qwen2.5-Coder-1.5B-Instruct) | gated-fresh | 48 | 12 | 0.73 [0.68, 0.78] (0.53, 0.83) | 0.19 [0.14, 0.24] (-0.01, 0.29) "
            "| 0.03 [-0.02, 0.08] (-0.17, 0.13) | `heads_heldout/qwen-1.5b/1` |") in text
    assert "frozen (attention)" not in text  # no run froze it: no empty column

