"""analysis.blend_section: the report's head-to-head tables, read from blend summaries."""

import json

import pandas as pd

from analysis.blend_section import blend_section


def _m(mean, lo=None, hi=None):
    return {"mean": mean, "ci_lo": mean if lo is None else lo, "ci_hi": mean if hi is None else hi, "n": 12}


def _summary(cos15):
    methods = {
        "full": {"recompute_fraction": 1.0, "cosine": _m(1.0), "task_score": _m(0.5), "ttft_ratio": _m(1.0)},
        "naive": {"recompute_fraction": 0.0, "cosine": _m(0.9, 0.85, 0.95), "task_score": _m(0.4), "ttft_ratio": _m(0.1)},
        "seam@2": {"recompute_fraction": 0.01, "cosine": _m(0.95), "task_score": _m(0.5), "ttft_ratio": _m(0.2)},
        "seam@4": {"recompute_fraction": 0.02, "cosine": _m(0.951), "task_score": _m(0.5), "ttft_ratio": _m(0.2)},
        "cacheblend@15%": {"recompute_fraction": 0.15, "cosine": _m(cos15, 0.97, 0.99), "task_score": _m(0.5),
                           "ttft_ratio": _m(0.4)},
        "cacheblend@20%": {"recompute_fraction": 0.2, "cosine": _m(0.99), "task_score": _m(0.5), "ttft_ratio": _m(0.5)},
        "cacheblend@5%": {"recompute_fraction": 0.05, "cosine": _m(0.93), "task_score": _m(0.4), "ttft_ratio": _m(0.2)},
    }
    return {"workloads": {"skills": {"n_items": 12, "methods": methods,
                                     "frontier": {"0.15": {"cosine": {"name": "cacheblend@15%", "value": cos15}}},
                                     "within_1pct_at_15pct": ["seam@2", "cacheblend@15%"]}}}


def _frame(tmp_path, runs):
    rows = []
    for run_id, model, summary in runs:
        d = tmp_path / run_id
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps(summary))
        rows.append({"job": "blend", "run_id": run_id, "model": model, "run_path": str(d)})
    rows.append({"job": "patching", "run_id": "patching/llama/x", "model": "llama", "run_path": str(tmp_path)})
    return pd.DataFrame(rows)


def test_the_section_shows_15_and_20_percent_methods_seams_and_the_newest_run_per_model(tmp_path):
    frame = _frame(tmp_path, [("blend/llama/2026-01-01", "llama", _summary(0.970)),
                              ("blend/llama/2026-01-02", "llama", _summary(0.981))])
    text = "\n".join(blend_section(frame))
    assert text.count("### ") == 1 and "blend/llama/2026-01-02" in text  # the newest run only
    assert "| cacheblend@15% | 0.150 | 0.981 [0.970, 0.990] |" in text
    assert "| cacheblend@20% | 0.200 |" in text and "| cacheblend@5% |" not in text  # 15 and 20 % only
    assert "| seam@2 |" in text and "| seam@4 |" not in text  # K = 2, 8, 32 only
    assert "| naive | 0.000 | 0.900 [0.850, 0.950] |" in text and "| full |" in text
    assert "<= 15%: cosine cacheblend@15% (0.981)" in text
    assert "task score (0.500) at <= 15 %: seam@2, cacheblend@15%" in text


def test_no_blend_run_no_section(tmp_path):
    assert blend_section(pd.DataFrame()) == []
    assert blend_section(_frame(tmp_path, [])) == []


def test_a_run_split_by_workload_is_merged_with_the_newest_run_of_each_workload(tmp_path):
    both = _summary(0.970)
    both["workloads"]["memory"] = both["workloads"]["skills"]
    skills_only = _summary(0.981)  # a later run of one workload replaces that workload only
    frame = _frame(tmp_path, [("blend/qwen-1.5b/2026-01-01", "qwen-1.5b", both),
                              ("blend/qwen-1.5b/2026-01-02", "qwen-1.5b", skills_only)])
    text = "\n".join(blend_section(frame))
    assert text.count("### ") == 2
    assert "skills (12 items; run `blend/qwen-1.5b/2026-01-02`)" in text
    assert "memory (12 items; run `blend/qwen-1.5b/2026-01-01`)" in text


def test_blend_runs_of_different_workloads_are_different_variants_and_records_merge_per_workload(tmp_path):
    import yaml

    from analysis.load import newest_per_workload, run_info

    for name, wls in (("a", ["skills", "memory", "locomo"]), ("b", ["skills"])):
        d = tmp_path / "blend" / "llama" / name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text(yaml.safe_dump({"experiment": {"name": "blend", "workloads": wls}}))
    variants = {run_info(tmp_path / "blend" / "llama" / n)["run_variant"] for n in "ab"}
    assert variants == {"skills+memory+locomo", "skills"}  # load(newest_only) keeps both
    rec = pd.DataFrame({"model": ["llama"] * 4, "workload": ["skills", "memory", "skills", "skills"],
                        "run_id": ["blend/llama/a", "blend/llama/a", "blend/llama/b", "blend/llama/b"]})
    kept = newest_per_workload(rec)
    assert kept.groupby("workload")["run_id"].unique().map(list).to_dict() == {
        "memory": ["blend/llama/a"], "skills": ["blend/llama/b"]}


def test_kvboost_rows_say_what_ran_and_identical_rows_are_named(tmp_path):
    """Issue #31 item 8: 'kvboost cacheblend@15%' re-prefilled every block token and equalled
    'kvboost selective@16'; the table said neither."""
    s = _summary(0.981)
    same = {"recompute_fraction": _m(1.0), "cosine": _m(0.999), "task_score": _m(0.5), "ttft_ratio": _m(1.1)}
    s["workloads"]["skills"]["methods"] |= {"kvboost cacheblend@15%": same, "kvboost selective@16": dict(same)}
    text = "\n".join(blend_section(_frame(tmp_path, [("blend/qwen-1.5b/2026-01-01", "qwen-1.5b", s)])))
    assert "| kvboost cacheblend@15% (ran: every block token re-prefilled) | 1.000 [" in text
    assert "| kvboost selective@16 (ran: every block token re-prefilled) |" in text
    assert "`kvboost cacheblend@15%` and `kvboost selective@16` gave the same mean" in text
    s["workloads"]["skills"]["methods"]["kvboost selective@16"]["cosine"] = _m(0.95)
    text = "\n".join(blend_section(_frame(tmp_path / "b", [("blend/qwen-1.5b/2026-01-01", "qwen-1.5b", s)])))
    assert "gave the same mean" not in text


def test_the_paired_comparison_with_cacheblend_is_shown_with_its_cluster_interval(tmp_path):
    s = _summary(0.975)
    diff = _m(0.2, 0.1, 0.3) | {"ci_cluster": {"mean": 0.2, "ci_lo": 0.05, "ci_hi": 0.35}}
    s["workloads"]["locomo"] = s["workloads"].pop("skills") | {"versus_cacheblend": {"15%": {
        "cacheblend": "cacheblend@15%", "beats": ["attribution@15%"], "beats_disjoint": [],
        "methods": {"attribution@15%": {"n": 48, "task_score": diff, "cosine": _m(0.001, -0.001, 0.003),
                                        "disjoint": False}}}}}
    text = "\n".join(blend_section(_frame(tmp_path, [("blend/qwen-1.5b/2026-01-01", "qwen-1.5b", s)])))
    assert "(conversation cluster bootstrap)" in text
    assert "| 15% | attribution@15% | 48 | 0.200 [0.100, 0.300] (0.050, 0.350) | 0.0010 [-0.0010, 0.0030] | yes | no |" in text
