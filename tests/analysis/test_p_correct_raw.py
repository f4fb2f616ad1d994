"""The P(correct) claims give the uncalibrated reading in the note beside the calibrated value
(one verdict, on the calibrated), and the report cross-checks p_correct_raw against summary.json."""

from __future__ import annotations

import json

from run_folders import write_run

from analysis import claims, load, report
from experiments.shared.edits import summarize_states

# item: (usable calibrated, score_stale, score_oracle, erratum score, field-only score, field-only correct calibrated)
ITEMS = {f"{d}/{i}": row for d in "abc" for i, row in enumerate([
    (True, -1.0, 2.0, 1.5, -0.8, False),   # usable both ways
    (True, 0.5, 3.0, 2.0, 0.7, True),      # stale picks new without the offset: raw unusable
    (False, -2.0, 0.4, 0.3, 0.2, False),   # raw usable only; field-only raw-correct
])}


def _rows() -> list[dict]:
    out = []
    for item, (u_p, st, orc, err, fo, fo_ok) in ITEMS.items():
        for strategy, s, ok in (("stale", st, False), ("oracle", orc, True), ("erratum", err, True),
                                ("field_only", fo, fo_ok)):
            out.append({"item_id": item, "domain": item[0], "strategy": strategy, "margin": 0.03,
                        "usable_recovery": True, "usable_p_correct": u_p, "score": s, "score_stale": st,
                        "score_oracle": orc, "correct": ok, "recovery": (s - st) / (orc - st),
                        "recompute_fraction": 0.1, "time_ratio": 0.5})
    return out


def _run(tmp_path):
    path = write_run(tmp_path, "edit", "llama", "2026-01-01_00-00-00", _rows(), kind="experiment", margin=0.03)
    (path / "summary.json").write_text(json.dumps({"kind": "experiment", "name": "edit", "model": "llama",
                                                   **summarize_states(_rows())}))
    return load.load(tmp_path)


def test_the_p_correct_claim_notes_the_uncalibrated_reading(tmp_path):
    out = claims.ours(_run(tmp_path), "field_only_p_correct").iloc[0]
    assert out["n"] == 6 and out["mean"] == 0.5  # calibrated: rows 0 and 1 of each domain
    assert "uncalibrated (raw argmax): 0.500 [" in out["note"] and "n = 6 items usable uncalibrated" in out["note"]
    err = claims.ours(_run(tmp_path / "e"), "erratum_p_correct").iloc[0]
    assert "uncalibrated (raw argmax): 1.000 [" in err["note"]


def test_the_report_keeps_one_verdict_and_cross_checks_p_correct_raw(tmp_path):
    frame = _run(tmp_path)
    text = report.render(frame, tmp_path, tmp_path / "fig", tmp_path / "REPORT.md")
    row = next(line for line in text.split("### field_only_p_correct")[1].splitlines() if line.startswith("| llama"))
    note = row.split(" | ")[-1]  # the uncalibrated reading: in the note, with no verdict of its own
    assert "uncalibrated (raw argmax)" in note and not any(w in note for w in ("consistent", "overlaps", "differs"))
    assert "`edit/llama/2026-01-01_00-00-00`: 8 of 8 summary.json means reproduced" in text
    assert "6 P(correct) uncalibrated" in text
    assert "P(correct) reads decisions calibrated against a content-free prompt" in text.split("## Verdicts")[0]
