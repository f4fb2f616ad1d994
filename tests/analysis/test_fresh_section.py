"""analysis.fresh_section: the tuned gated suite beside the fresh one, from each run's summary."""

import json

import pandas as pd

from analysis.fresh_section import fresh_section


def _ci(mean, lo, hi, n=48, **kw):
    return {"mean": mean, "ci_lo": lo, "ci_hi": hi, "n": n, **kw}


def _run(tmp_path, job, task, run_id, summary, variant=""):
    d = tmp_path / run_id.replace("/", "_")
    d.mkdir()
    (d / "summary.json").write_text(json.dumps(summary))
    return {"job": job, "model": "qwen-1.5b", "task": task, "run_id": run_id, "run_path": str(d), "run_variant": variant}


def _patching(field, notes):
    return {"n_items": 48, "n_usable": 45, "reading": "the paper's picture",
            "recovery": {"field_only": _ci(field, field - 0.01, field + 0.01), "notes_only": _ci(notes, notes - 0.01, notes + 0.01),
                         "full_downstream": _ci(1.0, 1.0, 1.0)}}


def _edit(k):
    return {"n_items": 48, "n_usable_recovery": 48, "n_usable_p_correct": 40,
            "strategies": {"erratum": {"p_correct": _ci(k / 40, 0.8, 1.0, n=40, k=k), "recovery": _ci(2.0, 1.5, 2.5),
                                        "recompute_fraction": _ci(0.15, 0.14, 0.16)}}}


def test_both_suites_side_by_side_with_wilson_usable_counts(tmp_path):
    rows = [_run(tmp_path, "patching", "gated", "patching/q/1", _patching(0.03, 0.97)),
            _run(tmp_path, "patching", "gated-fresh", "patching/q/2", _patching(0.05, 0.90))]
    text = "\n".join(fresh_section(pd.DataFrame(rows)))
    assert "| gated | `patching/q/1` | 45/48 [" in text and "0.970 [0.960, 0.980]" in text
    assert "| gated-fresh | `patching/q/2` |" in text and "0.900 [0.890, 0.910]" in text
    assert "Fresh suite, the probe's own reading: the paper's picture" in text
    assert "Edit: no run on both suites yet." in text


def test_edit_rows_and_cot_runs_left_out(tmp_path):
    rows = [_run(tmp_path, "edit", "gated", "edit/q/1", _edit(38)), _run(tmp_path, "edit", "gated-fresh", "edit/q/2", _edit(30)),
            _run(tmp_path, "edit", "gated-fresh", "edit/q/3", _edit(1), variant="cot")]
    text = "\n".join(fresh_section(pd.DataFrame(rows)))
    assert "| erratum | 38/40 0.95 [0.80, 1.00] | 2.000 [1.500, 2.500] | 30/40 0.75 [0.80, 1.00] |" in text
    assert text.count("| 0.150 / 0.150 |") == 1
    assert "1/40" not in text and "edit/q/3" not in text
    assert "Patching" not in text


def test_nothing_without_both_suites(tmp_path):
    rows = [_run(tmp_path, "patching", "gated", "patching/q/1", _patching(0.03, 0.97))]
    assert fresh_section(pd.DataFrame(rows)) == [] and fresh_section(pd.DataFrame()) == []
