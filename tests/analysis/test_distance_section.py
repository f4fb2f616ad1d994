"""analysis.distance_section: the distance sweep's tables and the takeover reading, from summaries."""

import json

import pandas as pd

from analysis.distance_section import MIN_USABLE, distance_section, reading, size_of, takeover


def _ci(mean, lo, hi):
    return {"mean": mean, "ci_lo": lo, "ci_hi": hi, "n": 12}


def _row(d, lo, n_usable=12):
    return {"distance": d, "n": 12, "n_usable": n_usable, "usable_share": _ci(n_usable / 12, 0.5, 1.0),
            "abs_delta": _ci(0.5, 0.4, 0.6), "field_only": _ci(0.2, 0.1, 0.3), "notes_only": _ci(0.7, 0.6, 0.8),
            "notes_minus_field": _ci(lo + 0.1, lo, lo + 0.2)}


def _per(*rows):
    return {str(r["distance"]): r for r in rows}


def test_takeover_is_the_smallest_distance_from_which_the_notes_stay_ahead():
    per = _per(_row(32, -0.1), _row(64, 0.05), _row(128, -0.02), _row(256, 0.1), _row(512, 0.2))
    assert takeover(per) == (256, [32, 64, 128, 256, 512], [64, 256, 512])  # 64 is ahead, 128 not: 256
    assert "take over at 256 tokens" in reading("m", per)


def test_too_few_usable_items_are_undetermined_and_left_out_of_the_rule():
    per = _per(_row(32, 0.1), _row(64, -0.5, n_usable=MIN_USABLE - 1), _row(128, 0.1))
    assert takeover(per) == (32, [32, 128], [32, 128])
    assert "ahead at every determined distance, from 32" in reading("m", per)
    assert "undetermined" in reading("m", _per(_row(32, 0.1, n_usable=2)))
    assert "not ahead of the field at any" in reading("m", _per(_row(32, -0.1), _row(64, 0.1), _row(128, -0.3)))


def test_size_is_read_from_the_label():
    assert size_of("llama (SmolLM2-135M-Instruct)") == 135e6
    assert size_of("qwen-1.5b (Qwen2.5-Coder-1.5B-Instruct)") == 1.5e9
    assert size_of("gemma (gemma-3-270m-it)") == 270e6
    assert size_of("tiny") == float("inf")


def test_the_section_orders_models_by_size_and_shows_each_table(tmp_path):
    rows = []
    for model, run_id, lo in (("qwen-1.5b", "distance/qwen-1.5b/2026-01-01", 0.1), ("llama", "distance/llama/2026-01-01", -0.1)):
        d = tmp_path / run_id
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"n_items": 12, "margin": 0.03,
                                                     "per_distance": _per(_row(32, lo), _row(64, lo))}))
        rows.append({"job": "distance", "run_id": run_id, "model": model, "run_path": str(d)})
    text = "\n".join(distance_section(pd.DataFrame(rows), "figures/distance.png"))
    assert text.index("SmolLM2") < text.index("Qwen2.5-Coder-1.5B")  # smallest first
    assert "| 32 | 12 / 12 | 1.00 [0.50, 1.00] | 0.500 [0.400, 0.600] | 0.200 [0.100, 0.300] |" in text
    assert "![distance](figures/distance.png)" in text and "By model size (smallest first)" in text
    assert distance_section(pd.DataFrame([{"job": "patching", "run_id": "x", "model": "llama", "run_path": "."}])) == []


def test_the_section_is_titled_by_what_the_sweep_varied(tmp_path):
    d = tmp_path / "distance/llama/2026-01-01"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"n_items": 12, "margin": 0.03, "per_distance": _per(_row(32, 0.1))}))
    text = "\n".join(distance_section(pd.DataFrame([{"job": "distance", "run_id": "r", "model": "llama",
                                                               "run_path": str(d)}])))
    assert text.startswith("## Field after the rule, filler downstream: recovery by distance")
    assert "where notes take over" not in text and "`+experiment=order`" in text
