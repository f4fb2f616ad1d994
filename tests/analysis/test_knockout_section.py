"""analysis.knockout_section: knockout read as decisions, raw and calibrated, beside random keys."""

import json

import pandas as pd

from analysis.knockout_section import knockout_section


def _share(k, n, lo, hi):
    return {"mean": k / n, "ci_lo": lo, "ci_hi": hi, "k": k, "n": n,
            "ci_cluster": {"cluster": "domain", "ci_lo": lo - 0.01, "ci_hi": hi + 0.01, "n_clusters": 12}}


def test_one_row_per_run_and_mask_with_the_missing_calibration_said(tmp_path):
    full, rerun = tmp_path / "full", tmp_path / "rerun"
    for d in (full, rerun):
        d.mkdir()
    no_cf = {"n": 0, "why": "the records carry no content-free score (score_cf)"}
    (full / "summary.json").write_text(json.dumps({
        "decision": {"flip_share": _share(17, 32, 0.36, 0.69), "flip_share_random": _share(2, 32, 0.02, 0.2),
                     "flip_share_calibrated": no_cf,
                     "decisions": {"top": {"reached_half": _share(30, 60, 0.38, 0.62), "away": _share(22, 60, 0.26, 0.49)}}},
        "after_notes": {"flip_share": _share(14, 32, 0.28, 0.61)}}))
    (rerun / "summary.json").write_text(json.dumps({
        "decision": {"flip_share": _share(17, 32, 0.36, 0.69), "flip_share_calibrated": _share(30, 58, 0.39, 0.64),
                     "flip_share_random_calibrated": _share(3, 58, 0.02, 0.14)}}))
    frame = pd.DataFrame([{"job": "knockout", "model": "qwen-1.5b", "run_id": f"knockout/q/{i}", "run_path": str(d)}
                          for i, d in ((1, full), (2, rerun))])
    text = "\n".join(knockout_section(frame))
    assert text.startswith("## Knockout read as decisions")
    assert ("| `knockout/q/1` | decision token only | 17/32 0.53 [0.36, 0.69] (0.35, 0.70) | 2/32 0.06 [0.02, 0.20] "
            "(0.01, 0.21) | - (not recorded) |") in text
    assert "| 30/60 0.50 [0.38, 0.62] (0.37, 0.63) | 22/60 0.37 [0.26, 0.49] (0.25, 0.50) |" in text
    assert "| `knockout/q/1` | every later query | 14/32" in text
    assert "| `knockout/q/2` | decision token only | 17/32 0.53 [0.36, 0.69] (0.35, 0.70) | - | 30/58 0.52" in text
    one = {"mean": 0.0, "ci_lo": 0.0, "ci_hi": 0.79, "k": 0, "n": 1, "ci_cluster": {"ci_lo": float("nan"), "ci_hi": float("nan")}}
    (full / "summary.json").write_text(json.dumps({"decision": {"flip_share": one}}))
    assert "| 0/1 0.00 [0.00, 0.79] | - |" in "\n".join(knockout_section(frame))  # no NaN cluster interval shown
    assert knockout_section(pd.DataFrame([{"job": "patching", "model": "q", "run_id": "p/1", "run_path": "."}])) == []
