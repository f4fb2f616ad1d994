"""Bands with a history (issue 31 item 6): every band records the commit that set it and whether a
report showing our value existed then; the report prints that, gives the verdict under a replaced
band beside the current one, and counts the rows on bands set after such a report apart."""

from __future__ import annotations

import copy
import re

import pytest
from run_folders import write_run

from analysis import aggregate, load, report, verdicts

SHA = re.compile(r"[0-9a-f]{7,40}")


def test_every_band_has_a_history_of_the_schema_the_report_reads():
    for cid, c in aggregate.reference()["claims"].items():
        if not c.get("target"):
            continue
        h = c.get("band_history")
        assert isinstance(h, dict), f"{cid}: a band without band_history"
        assert set(h) == {"set_in", "report_before", "replaced"}, cid
        assert isinstance(h["set_in"], str) and SHA.fullmatch(h["set_in"]), cid
        assert isinstance(h["report_before"], bool), cid
        r = h["replaced"]
        if r is not None:
            assert set(r) == {"target", "in"} and SHA.fullmatch(str(r["in"])), cid
            assert verdicts.band(r["target"]) is not None, cid  # a target the verdict function reads
            assert r["target"] != c["target"], cid


def test_the_bands_set_after_a_report_are_the_ones_9d30528_replaced():
    late = {cid for cid, c in aggregate.reference()["claims"].items() if report.post_hoc(c)}
    assert late == {"knockout_early", "knockout_mid", "knockout_late", "knockout_all", "erratum_p_correct",
                    "field_only_p_correct", "wording_bare", "wording_tagged", "wording_explicit", "compose_accuracy"}


@pytest.fixture()
def patched_reference(monkeypatch):
    ref = copy.deepcopy(aggregate.reference())
    ref["claims"]["field_only_recovery"]["band_history"] = {
        "set_in": "abcdef1", "report_before": True, "replaced": {"target": {"approx": 0.5, "tol": 0.1}, "in": "1234567"}}
    monkeypatch.setattr(report, "reference", lambda: ref)
    return ref


def _render(tmp_path) -> str:
    rows = [{"item_id": f"{d}/{i}", "domain": d, "condition": "field_only", "recovery": 0.03 + 0.01 * i,
             "score_stale": 0.0, "score_oracle": 4.0} for d in "abc" for i in range(4)]
    write_run(tmp_path, "patching", "llama", "2026-01-01_00-00-00", rows)
    return report.render(load.load(tmp_path), tmp_path, tmp_path / "fig", tmp_path / "REPORT.md")


def test_a_replaced_band_shows_both_verdicts_and_the_history(tmp_path, patched_reference):
    text = _render(tmp_path)
    block = text.split("### field_only_recovery")[1].split("### ")[0]
    assert "Band set in abcdef1; a report showing our value existed then: yes; it replaced the band [0.400, 0.600] set in 1234567" in block
    row = next(line for line in block.splitlines() if line.startswith("| llama"))
    verdict = row.split(" | ")[5]
    assert verdict.startswith("consistent") and "(under the replaced band [0.400, 0.600]: differs: ours is lower)" in verdict


def test_the_glance_table_counts_rows_on_late_bands_apart(tmp_path, patched_reference):
    glance = _render(tmp_path).split("## Verdicts at a glance")[1].split("## Claims")[0]
    assert "| verdict | claims x models | of them on a band set after a report showed our value |" in glance
    assert "| consistent | 1 | 1 |" in glance
    assert "1 row(s) stand on a band set after a committed report showed our value (field_only_recovery" in glance


def test_a_band_set_blind_says_so_and_keeps_one_verdict(tmp_path):
    text = _render(tmp_path)
    block = text.split("### field_only_recovery")[1].split("### ")[0]
    assert "a report showing our value existed then: no." in block and "replaced band" not in block
    assert "| consistent | 1 | 0 |" in text.split("## Claims")[0]


def test_how_to_read_names_docs_paper_and_says_not_every_band_was_blind(tmp_path):
    how = _render(tmp_path).split("## Verdicts at a glance")[0]
    assert "PAPER.md" not in how and "(docs/paper.md)" in how
    assert "before ours were read" not in how and "not written blind" in how


def test_the_code_and_docs_name_docs_paper_not_the_specification_file():
    root = aggregate.REFERENCE.parents[1]
    spec = "PAPER" + ".md"  # the specification outside the repository, never named in its files
    named = [str(p.relative_to(root)) for d in ("analysis", "benchmarks", "docs", "kvnotes", "experiments", "probes",
                                                  "runner", "serving")
             for p in (root / d).rglob("*") if p.suffix in {".py", ".md", ".yaml"} and spec in p.read_text()]
    assert not named
