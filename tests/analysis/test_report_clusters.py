"""The report's reading of issue 31: verdicts on the wider of the item and the domain-cluster
interval, the knockout claims read as decisions that go back, "about 0/1" said to be excluded or
not, and identity rows (full-downstream) kept out of the verdict count."""

from __future__ import annotations

import pandas as pd
from run_folders import write_run

from analysis import claims, load, report


def _patching(values_by_domain: dict[str, list[float]]) -> pd.DataFrame:
    rows = [{"model": "m", "run_id": "r", "item_id": f"{d}/{i}", "domain": d, "job": "patching", "task": "gated",
             "condition": "field_only", "recovery": v, "score_stale": 0.0, "score_oracle": 4.0, "dtype": "float32"}
            for d, vs in values_by_domain.items() for i, v in enumerate(vs)]
    return pd.DataFrame(rows)


def test_a_claim_uses_the_domain_cluster_interval_when_it_is_wider():
    # items of a domain alike, domains apart: 24 "items" but 4 independent values
    f = _patching({d: [v] * 6 for d, v in zip("abcd", (0.0, 0.02, 0.1, 0.3), strict=True)})
    item = claims.ci_table(f, "recovery", ["model"]).iloc[0]
    out = claims.records("patching", ["gated"], "recovery", condition="field_only")(f).iloc[0]
    assert out["hi"] - out["lo"] > 2 * (item["hi"] - item["lo"])
    assert "interval: cluster bootstrap (the wider" in out["note"] and "4 domains" in out["note"]
    # every domain holds the same spread: the domain means agree, the item interval is the wider and stands
    g = _patching({d: [0.0, 0.1, 0.2, 0.3, 0.4, 0.5] for d in "abcd"})
    same = claims.records("patching", ["gated"], "recovery", condition="field_only")(g).iloc[0]
    base = claims.ci_table(g, "recovery", ["model"]).iloc[0]
    assert "interval: item (the wider" in same["note"] and (same["lo"], same["hi"]) == (base["lo"], base["hi"])


def test_knockout_claims_count_decisions_that_go_back_over_items_that_can():
    rows = [{"model": "m", "run_id": "r", "job": "knockout", "task": "gated", "condition": "band", "band": "all",
             "item_id": f"i{i}", "domain": "abc"[i % 3], "score": s, "score_stale": st, "score_oracle": 2.0,
             "reverted": False}
            for i, (s, st) in enumerate([(-1.0, -1.0), (-0.2, -1.0), (0.5, -1.0), (3.0, -1.0), (-9.0, -1.0),
                                         (-1.0, 0.5)])]  # the last: both prompts decide new, nothing to go back to
    out = claims.ours(pd.DataFrame(rows), "knockout_all").iloc[0]
    assert out["n"] == 5 and out["mean"] == 3 / 5 and out["lo"] < 0.6 < out["hi"]
    assert out["note"].startswith("n = items whose old and new prompts decide differently")


def test_a_decisions_only_knockout_rerun_stands_beside_the_full_run_and_is_not_pooled(tmp_path):
    def band(n: int, flip: bool) -> list[dict]:
        return [{"item_id": f"{d}/{i}", "domain": d, "variant": "decision", "condition": "band", "band": "all",
                 "score": -1.0 if flip else 1.0, "score_stale": -1.0, "score_oracle": 2.0}
                for d in "abc" for i in range(n)]

    write_run(tmp_path, "knockout", "llama", "2026-01-01_00-00-00", band(4, flip=True))
    rerun = {"variants": ["decision"], "read_heads": False}  # e.g. again for the content-free score
    write_run(tmp_path, "knockout", "llama", "2026-02-01_00-00-00", band(5, flip=False), params=rerun)
    frame = load.load(tmp_path)
    assert sorted(frame.groupby("run_variant")["run_id"].nunique().items()) == [("", 1), ("decisions", 1)]
    out = claims.ours(frame, "knockout_all").iloc[0]
    assert out["n"] == 12 and out["mean"] == 1.0  # the full run's items only, although the rerun is newer


def test_about_0_and_about_1_say_whether_our_interval_excludes_them():
    assert report.excludes({"approx": 0.0, "tol": 0.1}, 0.015, 0.047) == "; our CI excludes 0"
    assert report.excludes({"approx": 1.0, "tol": 0.15}, 0.94, 1.01) == "; our CI includes 1"
    assert report.excludes({"range": [0.0, 0.2]}, 0.015, 0.047) == ""
    assert report.excludes({"approx": 0.5, "tol": 0.1}, 0.4, 0.6) == ""


def test_identity_rows_are_labelled_and_not_counted(tmp_path):
    rows = [{"item_id": f"{d}/{i}", "domain": d, "condition": c, "recovery": v, "score_stale": 0.0,
             "score_oracle": 4.0}
            for d in "abc" for i in range(4) for c, v in (("field_only", 0.03 + 0.01 * i), ("full_downstream", 1.0))]
    write_run(tmp_path, "patching", "llama", "2026-01-01_00-00-00", rows)
    frame = load.load(tmp_path)
    text = report.render(frame, tmp_path, tmp_path / "fig", tmp_path / "REPORT.md")
    assert "cluster bootstrap" in text.split("## Verdicts at a glance")[0]
    assert "identity, not a verdict" in text and "Not counted: 1 identity row(s)" in text
    glance = text.split("## Verdicts at a glance")[1].split("## Claims")[0]
    assert "identity" not in glance.split("Not counted")[0]
    assert "our CI excludes 0" in text  # field-only 0.03-0.06 at about 0
