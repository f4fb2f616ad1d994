"""The report's statistics: one bootstrap with the summaries, Wilson proportions, the zero rule,
usable counts from summary.json, and the reference set's refusal of runs from a dirty tree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from run_folders import seal

from analysis import aggregate, claims, load, reference, report, verdicts
from analysis.dtype_section import dtype_section
from kvnotes.measure.metrics import bootstrap_ci
from probes.parts.common import ci_dict


def test_report_and_summary_share_one_bootstrap():
    x = np.random.default_rng(1).normal(0.4, 0.3, 37)
    assert aggregate.mean_ci(x) == bootstrap_ci(x)  # same code, same defaults: identical intervals
    c = ci_dict(x)
    assert (c["mean"], c["ci_lo"], c["ci_hi"], c["n"]) == bootstrap_ci(x)


def _frame(values: dict[str, list[float]], column: str, **cols) -> pd.DataFrame:
    rows = [{"model": m, "run_id": f"r-{m}", "item_id": f"i{i}", "job": "edit", "task": "gated",
             "strategy": "erratum", "usable_p_correct": True, column: v, **cols}
            for m, vs in values.items() for i, v in enumerate(vs)]
    return pd.DataFrame(rows)


def test_proportions_in_the_report_get_wilson_not_a_zero_width_bootstrap():
    f = _frame({"llama": [1.0] * 30}, "correct")
    out = claims.records("edit", ["gated"], "correct", usable="usable_p_correct", strategy="erratum")(f)
    r = out.iloc[0]
    assert r["n"] == 30 and r["mean"] == 1.0 and r["hi"] == 1.0 and r["lo"] == pytest.approx(0.8865, abs=1e-4)
    t = aggregate.ci_table(f.assign(correct=[0.5] * 30), "correct", ["model"], proportion=True)
    assert t["lo"].iloc[0] == t["hi"].iloc[0] == 0.5  # not 0/1 outcomes: the bootstrap, as before


def test_recovery_within_one_bf16_step_of_zero_is_read_as_zero():
    rng = np.random.default_rng(0)
    f = pd.DataFrame({"model": "m", "run_id": "r", "item_id": [f"i{i}" for i in range(40)], "job": "patching",
                      "task": "gated", "condition": "field_only", "dtype": "bfloat16",
                      "recovery": rng.normal(0.06, 0.01, 40), "score_stale": 0.0, "score_oracle": 0.5})
    out = claims.records("patching", ["gated"], "recovery", condition="field_only")(f)
    eps = out["zero_eps"].iloc[0]
    assert eps == pytest.approx((1 / 16) / 0.5)  # one bf16 step over a 0.5-logit denominator: 0.125
    v = verdicts.verdict({"approx": 0.0, "tol": 0.1}, *out[["mean", "lo", "hi", "n"]].iloc[0], eps)
    assert v.startswith("consistent: zero within one score step")
    fp32 = claims.records("patching", ["gated"], "recovery", condition="field_only")(f.assign(dtype="float32"))
    assert fp32["zero_eps"].iloc[0] < 1e-5  # float32 resolves far below a bf16 step


def _run(root: Path, stamp: str, summary: dict, dirty: bool | None = False, forced: bool = False,
         attempts: list | None = None) -> Path:
    path = root / "patching" / "llama" / stamp
    path.mkdir(parents=True)
    cfg = {"model": {"name": "llama", "margin": 0.03}, "seed": 0, "task": {"name": "gated", "n_items": 40},
           "probe": {"name": "patching", "margin": None}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    meta = {"kind": "probe", "name": "patching", "model_name": "llama", "seed": 0, "status": "completed",
            "git": {"commit": "0123456789", "dirty": dirty}, "start_time": stamp, "dtype": "float32",
            "attempts": attempts or []}
    if forced:
        meta["reference"] = {"forced": True, "reason": "dirty"}
    (path / "meta.json").write_text(json.dumps(meta))
    rows = [{"item_id": f"i{i}", "condition": "field_only", "recovery": 0.1, "score_stale": 0.0, "score_oracle": 1.0}
            for i in range(40)]
    pd.DataFrame(rows).to_parquet(path / "records.parquet")
    (path / "summary.json").write_text(json.dumps(summary))
    return seal(path)


def test_runs_table_counts_usable_items_from_the_summary(tmp_path):
    summary = {"n_items": 40, "n_usable": 30, "margin": 0.03,
               "margin_rule": "margin 0.03: derived, margin = max(3 x RMS ...)"}
    _run(tmp_path, "2026-01-01_00-00-00", summary)
    lines = report.runs_section(load.load(tmp_path))
    assert "| 40 (30) |" in lines[-1] and "0.03 (derived)" in lines[-1] and "float32" in lines[-1]
    edit = {"n_items": 40, "n_usable_recovery": 31, "n_usable_p_correct": 28}
    assert report.usable_cell(edit, pd.DataFrame()) == "40 (31 recovery, 28 P(correct))"


def test_report_lists_runs_from_a_dirty_tree(tmp_path):
    _run(tmp_path, "2026-01-01_00-00-00", {"n_items": 40}, dirty=True, forced=True)
    frame = load.load(tmp_path)
    assert frame["forced"].iloc[0]
    text = "\n".join(report.dirty_section(frame))
    assert "1 of 1 runs" in text and "forced in with `analysis.reference --force`" in text
    clean = tmp_path / "clean"
    _run(clean, "2026-01-01_00-00-00", {"n_items": 40})
    assert report.dirty_section(load.load(clean)) == ["Every run read comes from a clean commit."]


def test_reference_refuses_a_dirty_run_unless_forced(tmp_path, capsys):
    runs = tmp_path / "runs"
    clean = _run(runs, "2026-01-01_00-00-00", {"n_items": 40})
    dirty = _run(runs, "2026-01-02_00-00-00", {"n_items": 40}, dirty=True)
    with pytest.raises(ValueError, match="dirty tree at commit 0123456"):
        reference.copy_run(dirty, tmp_path / "ref")
    # one dirty run in the batch: nothing is copied, the error says what to do
    assert reference.main([str(clean), str(dirty), "--to", str(tmp_path / "ref")]) == 2
    assert not (tmp_path / "ref").exists() and "--force" in capsys.readouterr().err
    assert reference.main([str(clean), str(dirty), "--to", str(tmp_path / "ref"), "--force"]) == 0
    copied = json.loads((tmp_path / "ref" / "patching" / "llama" / "2026-01-02_00-00-00" / "meta.json").read_text())
    assert copied["reference"]["forced"] and "dirty" in copied["reference"]["reason"]
    assert "reference" not in json.loads((tmp_path / "ref" / "patching" / "llama" / "2026-01-01_00-00-00"
                                          / "meta.json").read_text())


def test_reference_refuses_runs_without_git_state_or_resumed_across_commits(tmp_path):
    no_git = _run(tmp_path, "2026-01-01_00-00-00", {}, dirty=None)
    with pytest.raises(ValueError, match="records no git state at commit 0123456"):
        reference.check_run(no_git)
    two = _run(tmp_path, "2026-01-02_00-00-00", {}, attempts=[{"git_commit": "aaaaaaa1"}, {"git_commit": "bbbbbbb2"}])
    with pytest.raises(ValueError, match="resumed across 2 commits"):
        reference.check_run(two)
    assert reference.check_run(two, force=True)["status"] == "completed"


def test_quantile_ratio_ci_resamples_each_arm():
    rng = np.random.default_rng(0)
    a, b = rng.exponential(100, 60), rng.exponential(10, 80)
    point, lo, hi, n = aggregate.quantile_ratio_ci(a, b)
    assert n == 60 and lo < point < hi and 3 < point < 30
    assert math.isnan(aggregate.quantile_ratio_ci([1.0], [2.0])[1])


def _git(cwd: Path, *args: str) -> str:
    import subprocess
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin:/usr/local/bin"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_a_run_whose_commit_is_not_in_the_checkouts_history_is_refused_and_listed(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "commit", "-q", "--allow-empty", "-m", "landed")
    landed = _git(repo, "rev-parse", "HEAD")
    runs = tmp_path / "runs"
    ok = _run(runs, "2026-01-01_00-00-00", {"n_items": 40})
    lost = _run(runs, "2026-01-02_00-00-00", {"n_items": 40})
    for path, commit in ((ok, landed), (lost, "f" * 40)):  # a commit that never landed here
        meta = json.loads((path / "meta.json").read_text())
        meta["git"]["commit"] = commit
        (path / "meta.json").write_text(json.dumps(meta))
        seal(path)  # the run as it finished, at that commit
    ref = repo / "results" / "reference"
    assert reference.in_history(landed, ref) is True and reference.in_history("f" * 40, ref) is False
    assert reference.in_history(landed, tmp_path / "elsewhere") is None  # no checkout: not judged
    _git(repo, "commit", "-q", "--allow-empty", "-m", "next")
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{repo}", "shallow")
    assert reference.in_history(landed, tmp_path / "shallow") is None  # history cut off: cannot say no
    _git(repo, "reset", "-q", "--hard", landed)
    with pytest.raises(ValueError, match="fffffff is not in the history of this checkout"):
        reference.check_run(lost, repo=ref)
    assert reference.main([str(ok), str(lost), "--to", str(ref)]) == 2 and not ref.exists()
    assert reference.main([str(ok), str(lost), "--to", str(ref), "--force"]) == 0
    text = "\n".join(report.dirty_section(load.load(ref)))
    assert "fffffff, a commit not in this checkout's history): forced in" in text
    assert "2026-01-01" not in text  # the run from a landed commit is not listed


def test_a_bf16_run_beside_an_fp32_one_does_not_replace_it_and_the_dtype_section_compares_them(tmp_path):
    _run(tmp_path, "2026-01-01_00-00-00", {"n_items": 40})
    bf16 = _run(tmp_path, "2026-01-02_00-00-00", {"n_items": 40})  # newer, coarser
    meta = json.loads((bf16 / "meta.json").read_text())
    (bf16 / "meta.json").write_text(json.dumps({**meta, "dtype": "bfloat16"}))
    rows = [{"item_id": f"i{i}", "condition": c, "recovery": v + (0.05 if c == "field_only" else 0.0),
             "score_stale": 0.0, "score_oracle": 0.5}
            for i in range(30) for c, v in (("field_only", 0.1), ("notes_only", 0.9))]  # 30 usable of 40
    pd.DataFrame(rows).to_parquet(bf16 / "records.parquet")
    frame = load.load(tmp_path)
    assert set(frame["run_id"]) == {"patching/llama/2026-01-01_00-00-00"}  # the claims read the fp32 run
    text = "\n".join(dtype_section(tmp_path))
    assert "## What the dtype changes" in text
    assert "| float32 | `patching/llama/2026-01-01_00-00-00` | 40 | 0.100 [0.100, 0.100] | - | - | 0.062 |" in text
    assert "| bfloat16 | `patching/llama/2026-01-02_00-00-00` | 30 | 0.150 [0.150, 0.150] | 0.900 [0.900, 0.900] | - | 0.125 |" in text
    assert "over the 30 items usable in both runs: field_only 0.050 [0.050, 0.050]" in text
    only = tmp_path / "only"
    _run(only, "2026-01-01_00-00-00", {"n_items": 40})
    assert dtype_section(only) == []  # one dtype: no section


def test_serving_hit_rate_gets_a_wilson_interval_over_cache_blocks_never_zero_width():
    rows = [{"model": "m", "run_id": "r", "run_path": "/nonexistent", "job": "serving", "variant": v,
             "phase": ph, "rate": rate, "request_id": f"{v}{ph}{i}", "ttft_s": 0.5, "status": "ok",
             "phase_hit_rate": hit / 1024, "phase_hit_tokens": 12 * hit, "phase_query_tokens": 12 * 1024}
            for v, hit in (("edit", 32), ("erratum", 960)) for ph, rate in (("sequential", math.nan),
                                                                          ("poisson", 0.2), ("overload", 1.0))
            for i in range(12)]
    frame = pd.DataFrame(rows)
    edit = claims.ours(frame, "serving_hit_rate_inplace").iloc[0]
    # every phase hit exactly one 32-token block of 32 per request: the same ratio three times,
    # which a bootstrap over phases turns into a zero-width interval
    assert edit["mean"] == pytest.approx(1 / 32) and edit["n"] == 3 * 12 * 32
    assert edit["lo"] < 1 / 32 < edit["hi"] and "Wilson over the cache blocks" in edit["note"]
    err = claims.ours(frame, "serving_hit_rate_erratum").iloc[0]
    assert err["mean"] == pytest.approx(960 / 1024) and err["lo"] < err["mean"] < err["hi"] < 1


def test_a_claim_its_run_leaves_undefined_says_why_not_no_run(monkeypatch):
    runs = {"linear": [("qwen-1.5b", "r1", {"write_depth": float("nan"), "write_depth_why": "truth labels: never 0.9.",
                                             "reading": "model labels: best 0.79; truth labels: best 0.73."}),
                       ("llama", "r2", {"write_depth": 0.4, "write_depth_why": None})],
            "scrub": []}
    monkeypatch.setattr(load, "newest_summaries", lambda frame, job: runs[job])
    assert report.undefined_reasons(pd.DataFrame(), "linear") == [
        ("qwen-1.5b", "model labels: best 0.79; truth labels: best 0.73")]  # the reading, without its full stop
    assert report.undefined_reasons(pd.DataFrame(), "scrub") == []
    runs["linear"][0][2].pop("reading")
    assert report.undefined_reasons(pd.DataFrame(), "linear") == [("qwen-1.5b", "truth labels: never 0.9")]
