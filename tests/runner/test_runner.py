"""experiments.run end to end on a tiny random model: run dir, provenance, resume, errors."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pandas as pd
import pytest
from hydra import compose
from omegaconf import OmegaConf
from tiny_runs import ROOT, SMALL, TINY, hydra_ready, read, selfcheck_cfg  # noqa: F401

import kvnotes.compose.splice
import runner.context as runner_context
import runner.main as runner
from kvnotes.models import WeightsError
from runner import jobs as registry
from runner.config import ConfigError
from runner.rundir import RecordWriter, config_hash, find_unfinished

# --- RecordWriter ---------------------------------------------------------------------------


def test_record_writer_units_are_atomic_and_resumable(tmp_path):
    w = RecordWriter(tmp_path)
    assert not w.done("a/1")
    w.write("a/1", [{"x": 1.0, "y": "p"}, {"x": float("nan"), "y": "q"}])
    w.write("b", [])  # an empty unit still counts as done
    assert w.done("a/1") and w.done("b") and not w.done("c")
    assert not list(w.parts.glob(".*"))  # no temporary files left behind
    frame = w.finalize()
    assert len(frame) == 2 and set(frame["unit"]) == {"a/1"}
    assert math.isnan(frame["x"].iloc[1])  # NaN stays NaN
    on_disk = pd.read_parquet(tmp_path / "records.parquet")
    assert math.isnan(on_disk["x"].iloc[1]) and w.done("a/1")  # parts kept until cleanup
    w.cleanup()
    assert not w.parts.exists()


def test_record_writer_refuses_a_unit_column(tmp_path):
    with pytest.raises(ValueError, match="unit"):
        RecordWriter(tmp_path).write("k", [{"unit": 3}])


def test_config_hash_ignores_bookkeeping_keys(tmp_path):
    a = selfcheck_cfg(tmp_path)
    assert config_hash(a, "cpu") == config_hash(selfcheck_cfg(tmp_path / "x", "resume=false"), "cpu")
    assert config_hash(a, "cpu") != config_hash(selfcheck_cfg(tmp_path, "seed=1"), "cpu")
    assert config_hash(a, "cpu") != config_hash(a, "cuda:0")


# --- selfcheck end to end -------------------------------------------------------------------


def test_selfcheck_end_to_end(tmp_path):
    run_dir = runner.run(selfcheck_cfg(tmp_path))
    assert run_dir.parent == tmp_path / "selfcheck" / "tiny-llama"
    assert {p.name for p in run_dir.iterdir() if not p.name.startswith(".")} == {
        "config.yaml", "meta.json", "records.parquet", "summary.json", "command.txt", "overrides.yaml",
        "run.log"}
    assert not (run_dir / ".holder.json").exists()  # the lock is released with the run
    assert OmegaConf.load(run_dir / "config.yaml").experiment.n_blocks == 3
    meta = read(run_dir / "meta.json")
    assert meta["status"] == "completed" and meta["error"] is None
    assert meta["git"]["commit"] and {"torch", "transformers", "hydra-core"} <= set(meta["packages"])
    assert meta["model"]["model"] == "tiny-llama" and meta["dtype"] == "float32"
    assert meta["device"] == "cpu" and meta["seed"] == 0 and meta["wall_s"] > 0
    records = pd.read_parquet(run_dir / "records.parquet")
    assert len(records) == 3 * 3 and sorted(records["seam"].unique()) == [0, 1, 4]
    assert records["cosine"].between(-1, 1.000001).all()
    assert (records["max_abs_diff_extend"] < 1e-4).all()
    assert (records["max_abs_diff_splice_full"] < 1e-4).all()
    summary = read(run_dir / "summary.json")
    assert summary["n_records"] == 9 and set(summary["seams"]) == {"0", "1", "4"}
    s0 = summary["seams"]["0"]
    assert s0["n"] == 3 and s0["cosine_lo"] <= s0["cosine"] <= s0["cosine_hi"]
    assert summary["exact"]["pass"] is True and isinstance(summary["pass"], bool)
    assert not (tmp_path / "outputs").exists() and not (ROOT / "outputs").exists()


def test_interrupted_run_resumes_and_skips_done_units(tmp_path, monkeypatch):
    real = kvnotes.compose.splice.self_check
    calls = []
    interrupt_at = {2}  # the second call of the first attempt, once

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) in interrupt_at:
            interrupt_at.clear()
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(kvnotes.compose.splice, "self_check", flaky)
    with pytest.raises(KeyboardInterrupt):
        runner.run(selfcheck_cfg(tmp_path))
    (first,) = (tmp_path / "selfcheck" / "tiny-llama").iterdir()
    assert read(first / "meta.json")["status"] == "interrupted"
    assert [p.name for p in (first / "parts").glob("*.parquet")] == ["block-000.parquet"]

    calls.clear()
    run_dir = runner.run(selfcheck_cfg(tmp_path))
    assert run_dir == first and len(calls) == 2  # blocks 1 and 2 only
    meta = read(run_dir / "meta.json")
    assert meta["status"] == "completed" and len(meta["attempts"]) == 2
    assert sorted(pd.read_parquet(run_dir / "records.parquet")["block"].unique()) == [0, 1, 2]

    again = runner.run(selfcheck_cfg(tmp_path))  # a completed run is not resumed
    assert again != run_dir and len(calls) == 5


def _failed_run(tmp_path, monkeypatch):
    """The run dir of a selfcheck run whose first unit raised (the patch undone after)."""
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(kvnotes.compose.splice, "self_check", broken)
    with pytest.raises(RuntimeError):
        runner.run(selfcheck_cfg(tmp_path))
    monkeypatch.undo()
    (failed,) = (tmp_path / "selfcheck" / "tiny-llama").iterdir()
    return failed


def test_failed_run_records_the_error_and_resume_false_starts_fresh(tmp_path, monkeypatch):
    failed = _failed_run(tmp_path, monkeypatch)
    parent = failed.parent
    meta = read(failed / "meta.json")
    assert meta["status"] == "failed" and "boom" in meta["error"]
    assert find_unfinished(parent, meta["config_hash"]) == failed
    fresh = runner.run(selfcheck_cfg(tmp_path, "resume=false"))
    assert fresh != failed and read(failed / "meta.json")["status"] == "failed"


def test_an_unfinished_run_from_another_commit_is_not_resumed_silently(tmp_path, monkeypatch):
    from runner.rundir import RunDirError

    failed = _failed_run(tmp_path, monkeypatch)
    meta = read(failed / "meta.json")
    meta["git"]["commit"] = "0" * 40
    for a in meta["attempts"]:
        a["git_commit"] = "0" * 40
    (failed / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunDirError, match="started at commit 0000000, this code is at .*resume=false"):
        runner.run(selfcheck_cfg(tmp_path))
    assert read(failed / "meta.json")["attempts"] == meta["attempts"]  # untouched, and unlocked:
    fresh = runner.run(selfcheck_cfg(tmp_path, "resume=false"))
    assert fresh != failed and read(fresh / "meta.json")["status"] == "completed"


def test_failed_summary_keeps_units_for_the_rerun(tmp_path, monkeypatch):
    entry = registry.get("experiment", "selfcheck")

    def broken_summary(records, cfg):
        raise ValueError("bad summary")

    monkeypatch.setitem(registry._ENTRIES, ("experiment", "selfcheck"),
                        dataclasses.replace(entry, summarize=broken_summary))
    with pytest.raises(ValueError, match="bad summary"):
        runner.run(selfcheck_cfg(tmp_path))
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(kvnotes.compose.splice, "self_check", lambda *a, **k: calls.append(1))
    run_dir = runner.run(selfcheck_cfg(tmp_path))
    assert calls == [] and read(run_dir / "summary.json")["n_records"] == 9


# --- probes through the dispatcher ----------------------------------------------------------


@dataclass
class FakeProbeConfig:
    unit_size: int = 2
    offset: float = 0.0


def test_probe_dispatch_in_units_with_resume(tmp_path, monkeypatch):
    seen: list[list[str]] = []
    interrupt = []  # set: interrupt once, at the second unit

    def fake_probe(model, items, cfg):
        seen.append([it["item_id"] for it in items])
        if len(seen) == 2 and interrupt:
            interrupt.clear()
            raise KeyboardInterrupt
        return [{"item_id": it["item_id"], "value": cfg.offset + it["x"]} for it in items]

    entry = registry.Entry("fake", "probe", fake_probe, None, FakeProbeConfig, "test probe")
    monkeypatch.setitem(registry._ENTRIES, ("probe", "fake"), entry)
    items = [{"item_id": f"i{k}", "x": float(k)} for k in range(5)]
    monkeypatch.setattr(runner_context, "load_items", lambda model, cfg: items)
    cfg = compose("config", overrides=[f"results_dir={tmp_path}", "progress=false", *TINY])
    OmegaConf.update(cfg, "probe", {"name": "fake", "offset": 10.0}, force_add=True)

    run_dir = runner.run(cfg)
    assert seen == [["i0", "i1"], ["i2", "i3"], ["i4"]]  # units of unit_size items
    records = pd.read_parquet(run_dir / "records.parquet")
    assert records["value"].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]

    seen.clear()
    OmegaConf.update(cfg, "probe.offset", -1.0)
    interrupt.append(True)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cfg)
    assert read(run_dir / "summary.json")["n_records"] == 5  # a new config: a new run dir
    seen.clear()
    resumed = runner.run(cfg)
    assert seen == [["i2", "i3"], ["i4"]] and resumed != run_dir
    assert pd.read_parquet(resumed / "records.parquet")["value"].tolist() == [-1.0, 0.0, 1.0, 2.0, 3.0]
    assert read(run_dir / "summary.json")["n_records"] == 5


def test_a_job_logs_its_memory_estimate_and_refuses_what_cannot_fit(tmp_path, monkeypatch):
    from kvnotes.measure import timing
    from kvnotes.measure.timing import MemoryBudgetError

    seen = []
    entry = registry.Entry("fake", "probe", lambda m, items, c: seen.append(1) or [], None, None, "")
    monkeypatch.setitem(registry._ENTRIES, ("probe", "fake"), entry)
    monkeypatch.setattr(runner_context, "load_items", lambda model, cfg: [{"item_id": "i0"}])
    cfg = compose("config", overrides=[f"results_dir={tmp_path}", "progress=false", "threads=1", *TINY])
    OmegaConf.update(cfg, "probe", {"name": "fake"}, force_add=True)
    run_dir = runner.run(cfg)
    log_text = (run_dir / "run.log").read_text()
    assert "estimated peak memory" in log_text and "torch threads: 1 (threads= in the config)" in log_text
    monkeypatch.setattr(timing, "available_bytes", lambda device: 1024)
    # task.length=700: the tiny tokenizer's gated prompts need 695 tokens, checked before the memory
    with pytest.raises(MemoryBudgetError, match="does not fit"):
        runner.run(compose("config", overrides=[f"results_dir={tmp_path / 'b'}", "progress=false", *TINY,
                                                "+probe=patching", "task.length=700"]))
    assert seen == [1]  # the refused job never ran


def test_probe_without_task_suite_fails_clearly(tmp_path, monkeypatch):
    entry = registry.Entry("fake", "probe", lambda m, i, c: [], None, None, "")
    monkeypatch.setitem(registry._ENTRIES, ("probe", "fake"), entry)
    cfg = compose("config", overrides=[f"results_dir={tmp_path}", "progress=false", "~task", *TINY])
    OmegaConf.update(cfg, "probe", {"name": "fake"}, force_add=True)
    with pytest.raises(ConfigError, match="task"):
        runner.run(cfg)


# --- errors ---------------------------------------------------------------------------------


def test_no_job_lists_valid_names_before_anything_is_written(tmp_path):
    cfg = compose("config", overrides=[f"results_dir={tmp_path}", *TINY])
    with pytest.raises(ConfigError, match="valid probes: .*valid experiments: .*selfcheck"):
        runner.run(cfg)
    assert not list(tmp_path.iterdir())


def test_cli_without_job_exits_nonzero_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "experiments.run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "valid experiments: " in proc.stderr and "selfcheck" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # Hydra left nothing in the working directory


# --- the real model -------------------------------------------------------------------------


@pytest.mark.real
def test_selfcheck_on_real_llama(tmp_path):
    overrides = ["model=llama", "device=cpu", "experiment.n_blocks=1",
                 "experiment.block_sentences=4", "experiment.prefix_sentences=2",
                 "experiment.seams=[0,2]", "experiment.n_boot=50", "progress=false"]
    cfg = compose("config", overrides=["+experiment=selfcheck", f"results_dir={tmp_path}", *overrides])
    try:
        run_dir = runner.run(cfg)
    except WeightsError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    meta = read(run_dir / "meta.json")
    assert meta["model"]["weights_sha256"] and meta["status"] == "completed"
    summary = read(run_dir / "summary.json")
    assert summary["exact"]["pass"] is True
    assert summary["seams"]["0"]["cosine"] > 0.9
    assert summary["seams"]["2"]["cosine"] >= summary["seams"]["0"]["cosine"] - 0.01


# --- multirun launchers -----------------------------------------------------------------------


def test_two_job_joblib_multirun_writes_one_run_dir_per_job(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "experiments.run", "-m", "+experiment=selfcheck", *TINY, *SMALL,
           "seed=0,1", "hydra/launcher=parallel", "hydra.launcher.n_jobs=2", f"results_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout + proc.stderr
    runs = sorted((tmp_path / "selfcheck" / "tiny-llama").iterdir())
    assert len(runs) == 2
    metas = [read(r / "meta.json") for r in runs]
    assert sorted(m["seed"] for m in metas) == [0, 1]
    assert all(m["status"] == "completed" for m in metas)
    assert all((r / "summary.json").exists() for r in runs)
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // min(2, cores))  # two jobs at once split the cores
    assert all(f"torch threads: {threads} ({cores} cores / " in (r / "run.log").read_text() for r in runs)


def test_slurm_launcher_config_composes_to_submitit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "experiments.run", "+experiment=selfcheck", *TINY,
           "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra", "-p", "hydra.launcher"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    launcher = OmegaConf.create(proc.stdout)
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert launcher.partition == "gpu" and launcher.gpus_per_node == 1 and launcher.timeout_min == 240


def test_summary_table_pivots_repeated_metrics_and_lists_curves():
    from runner.rundir import summary_table

    ci = {"mean": 0.5, "ci_lo": 0.25, "ci_hi": 0.75, "n": 8}
    wide = summary_table({"kind": "experiment", "name": "edit", "model": "m", "n_items": 8,
                          "strategies": {"erratum": {"p_correct": ci, "recovery": ci},
                                         "field_only": {"p_correct": ci, "recovery": ci}}})
    lines = wide.splitlines()
    assert lines[0] == "experiment edit m" and lines[1] == "n_items=8"
    assert lines[2].split() == ["p_correct", "recovery"]
    assert lines[3].startswith("strategies.erratum") and lines[3].count("0.500 [0.250, 0.750] n=8") == 2
    long = summary_table({"recovery": {"field_only": ci}, "curve": [{"k": 20.0, **ci}],
                          "seams": {"0": {"cosine": {"mean": 0.9, "ci_lo": 0.8, "ci_hi": 1.0, "n": 3}}}})
    assert "recovery.field_only" in long and "curve[k=20]" in long and "0.900 [0.800, 1.000] n=3" in long


def test_resummarize_rebuilds_the_summary_from_records(tmp_path):
    from runner import summarize

    run_dir = runner.run(selfcheck_cfg(tmp_path))
    before = read(run_dir / "summary.json")
    (run_dir / "summary.json").unlink()
    after = summarize.resummarize(run_dir)
    assert read(run_dir / "summary.json") == after and after["resummarized"]
    assert after["resummarized_commit"] and "resummarized_dirty" in after  # which code summarised again
    strip = {"finished", "resummarized", "resummarized_commit", "resummarized_dirty"}
    assert {k: v for k, v in after.items() if k not in strip} == {k: v for k, v in before.items() if k not in strip}
    assert summarize.main([str(tmp_path / "nowhere")]) == 2


def test_a_batch_records_the_code_state_taken_before_its_first_rewrite(tmp_path, monkeypatch):
    """Rewriting summaries in place dirties the tree; a batch keeps the state read before it wrote."""
    from runner import summarize

    run_dir = runner.run(selfcheck_cfg(tmp_path))
    calls = []

    def state():
        calls.append(1)
        return {"commit": "abc", "dirty": len(calls) > 1}  # clean before the first write, dirty after

    monkeypatch.setattr(summarize, "git_state", state)
    assert summarize.main([str(run_dir), str(run_dir)]) == 0
    assert len(calls) == 1 and read(run_dir / "summary.json")["resummarized_dirty"] is False


def test_edit_experiment_end_to_end_and_cot_only(tmp_path):
    base = ["+experiment=edit", f"results_dir={tmp_path}", *TINY, "model.margin=0", "task=gated",
            "task.n_items=2", "task.length=700", "progress=false"]
    run_dir = runner.run(compose("config", overrides=base))
    rec = pd.read_parquet(run_dir / "records.parquet")
    assert rec["calibrated"].all() and {"pick", "pick_raw", "oracle_pick"} <= set(rec.columns)
    full = rec[rec["strategy"] == "full_downstream"]
    assert full["correct"].all() and (full["recovery"] - 1).abs().max() < 1e-4
    summary = read(run_dir / "summary.json")
    assert summary["n_items"] == 2 and {"p_correct", "recovery", "recompute_fraction", "time_ratio"} <= set(
        summary["strategies"]["erratum"])
    cot = runner.run(compose("config", overrides=[*base, "experiment.cot_only=true", "experiment.cot_tokens=2",
                                                  "experiment.strategies=[field_only,erratum]"]))
    strategies = set(pd.read_parquet(cot / "records.parquet")["strategy"])
    assert strategies == {"stale+cot", "oracle+cot", "field_only+cot", "erratum+cot"}


def test_a_finished_run_says_how_to_read_it_with_the_figures_and_the_report(tmp_path):
    """figures and report read results/reference by default; a user's run now prints the flags that
    point both at its own results folder (and write beside it, not over the committed figures)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "experiments.run", "+experiment=selfcheck", *TINY, *SMALL,
           "threads=1", "results_dir=mine/runs"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tail = proc.stdout.splitlines()[-5:]
    assert tail[0].startswith("run dir: ") and "mine/runs/selfcheck/tiny-llama/" in tail[0]
    assert tail[2] == "  python -m analysis.figures --results mine/runs --out mine/runs/figures"
    assert tail[3] == ("  kvnotes report --results mine/runs --figures mine/runs/figures "
                       "--out mine/runs/REPORT.md")
    assert "results/reference" in tail[4]


def test_reading_tip_quotes_paths_and_keeps_an_outside_folder_absolute(tmp_path):
    from runner.endings import reading_tip

    run = tmp_path / "my runs" / "edit" / "llama" / "2026-01-01_00-00-00"
    tip = reading_tip(run, cwd=tmp_path / "elsewhere")
    assert f"--results '{tmp_path / 'my runs'}'" in tip
    assert "--results 'my runs'" in reading_tip(run, cwd=tmp_path)
