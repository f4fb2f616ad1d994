"""The report's own-prompts section reads task=pairs runs only, and no other section reads them."""

from __future__ import annotations

import json

from run_folders import write_run

from analysis import load
from analysis.pairs_section import pairs_section, spread


def _patching(root, task: str, recoveries: list[float], stamp: str):
    rows = [{"item_id": f"p{i}", "domain": f"c{i % 2}", "condition": "notes_only", "recovery": r,
             "score_stale": 0.0, "score_oracle": 1.0, "margin": 0.03}
            for i, r in enumerate(recoveries)]
    path = write_run(root, "patching", "llama", stamp, rows, task=task)
    summary = {"kind": "probe", "name": "patching", "model": "llama", "n_items": len(rows), "n_usable": len(rows),
               "recovery": {"notes_only": {"mean": sum(recoveries) / len(rows), "ci_lo": 0.1, "ci_hi": 0.9,
                                           "n": len(rows)}}}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_pairs_runs_stay_out_of_the_suite_readings_and_get_their_own_section(tmp_path):
    _patching(tmp_path, "pairs", [-0.5, 0.5, 1.0, 2.0], "2026-01-02_00-00-00")
    _patching(tmp_path, "gated", [0.9, 1.0, 1.1, 1.0], "2026-01-01_00-00-00")
    frame = load.load(tmp_path)
    assert set(load.select(frame, "patching").task) == {"gated"}
    assert [m for m, _, _ in load.summaries(frame, "patching")] == ["llama"]
    text = "\n".join(pairs_section(frame))
    assert "Your own prompts" in text and "< 0: 1/4" in text and "> 1.5: 1/4" in text
    assert pairs_section(load.load(tmp_path / "none")) == []


def test_spread_names_the_distribution_a_mean_hides():
    import numpy as np
    assert spread(np.array([0.0, 1.0, 2.0, float("nan")])) == "1.00 [0.50, 1.50]; < 0: 0/3, > 1.5: 1/3"
    assert spread(np.zeros(0)) == "-"
