"""analysis.attribution_section: the report's attribution-vs-exact table and the cost rows."""

import json

import pandas as pd

from analysis.attribution_section import attribution_section


def _m(mean, lo, hi, n=24):
    return {"mean": mean, "ci_lo": lo, "ci_hi": hi, "n": n}


def _run(tmp_path, run_id, summary):
    d = tmp_path / run_id
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(summary))
    return {"job": "attribution", "run_id": run_id, "model": "qwen-1.5b", "run_path": str(d)}


def test_rows_say_which_cells_were_read_and_give_the_cluster_interval(tmp_path):
    stats = {"spearman_position": _m(0.975, 0.970, 0.979), "spearman_position_layer": _m(0.81, 0.78, 0.84),
             "n_layer_cells": _m(1024, 1024, 1024), "n_layer_cells_all": _m(8400, 8000, 8800),
             "overlap_8": _m(0.9, 0.87, 0.93), "recovery_top8_attribution": _m(0.96, 0.73, 1.36),
             "recovery_top8_exact": _m(1.06, 0.75, 1.64)}
    s = {"n_items": 30, "n_usable": 30, "stats": stats, "cost_exact_over_attribution": 6.2,
         "stats_cluster": {"spearman_position": {"mean": 0.975, "ci_lo": 0.965, "ci_hi": 0.982}},
         "worst_layer_counts": {"3": 2}}
    bench = tmp_path / "ref" / "benchmarks"
    bench.mkdir(parents=True)
    (bench / "engine_x.json").write_text(json.dumps([
        {"length": 1000, "prefill_s": 1.5, "map_ratio": 1.3, "attribution_ratio": 0.135, "map_over_attribution": 9.6,
         "model": "llama", "dtype": "float32", "reps": 3, "cpu": {"model": "Xeon"}},
        {"length": 1000, "prefill_s": 1.5}]))
    frame = pd.DataFrame([_run(tmp_path, "attribution/qwen-1.5b/2026-01-01", s)])
    text = "\n".join(attribution_section(frame, tmp_path / "ref"))
    assert "0.975 [0.970, 0.979] (0.965, 0.982)" in text
    assert "a uniform sample of 1024 of 8400 cells per item" in text and "6.2x" in text
    assert "| llama float32 | 1000 | 1.50 | 1.30 | 0.135 | 9.6 | 3 | Xeon | `engine_x.json` |" in text
    assert text.count("| llama float32 |") == 1  # a row without attribution_ratio is not a cost row


def test_a_full_run_states_the_sample_error_and_no_run_no_section(tmp_path):
    s = {"n_items": 12, "n_usable": 9, "stats": {"spearman_position_layer": _m(0.83, 0.81, 0.85, 9)},
         "layer_sample_error": {"cells": 1024, "mean": -0.004, "max_abs": 0.02, "n": 9}}
    text = "\n".join(attribution_section(pd.DataFrame([_run(tmp_path, "attribution/llama/x", s)]), tmp_path))
    assert "every cell (a 1024-cell sample of the same items is off by -0.004 on average, at most 0.020)" in text
    assert "No committed benchmark timed both maps yet." in text
    assert attribution_section(pd.DataFrame(), tmp_path) == []
