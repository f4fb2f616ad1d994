"""analysis/: tidy loading, bootstrap CIs, every figure and the report, on synthetic run folders.

The records here are synthetic (random numbers), but each has the columns its probe or
experiment writes (probes/*.py, experiments/*.py), in run folders laid out as experiments.run
lays them out. Synthetic numbers are for these tests only; no committed figure is drawn from them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from run_folders import N_ITEMS, seal, write_run

from analysis import aggregate, claims, load, report, verdicts
from analysis.figures import FIGURES, Skip, build_all
from analysis.figures import __main__ as figures_cli
from kvnotes.measure.metrics import bootstrap_ci

RNG = np.random.default_rng(0)
LAYERS = 6
DOMAINS = ["refund", "access", "deploy"]


def item_base(i: int, suite: str = "gated", margin: float = 1.0) -> dict:
    return {"item_id": f"{suite}/s0/L400/{i:04d}/{DOMAINS[i % 3]}", "suite": suite,
            "domain": DOMAINS[i % 3], "template_id": f"{DOMAINS[i % 3]}/rule0/req{i % 2}",
            "variant": "field", "n_tokens": 40, "field_start": 5, "field_end": 7, "margin": margin,
            "score_stale": -2.0, "score_oracle": 2.0}


def patching_records(suite: str = "gated") -> list[dict]:
    rows = []
    for i in range(N_ITEMS):
        b = item_base(i, suite)
        if i == N_ITEMS - 1:  # one skipped item, as the probe writes it
            rows.append({**b, "condition": "skipped", "reason": "|score_new - score_old| = 0.1 < margin 1"})
            continue
        for c, r in (("stale", 0.0), ("field_only", RNG.normal(0, 0.05)), ("notes_only", RNG.normal(1, 0.1)),
                     ("full_downstream", 1.0), ("oracle", 1.0)):
            rows.append({**b, "condition": c, "score": r, "recovery": r})
        rows += [{**b, "condition": "layer", "layer": float(layer), "rel_layer": layer / (LAYERS - 1),
                  "score": 0.0, "recovery": RNG.normal(0.3, 0.1)} for layer in range(LAYERS)]
        tokens = np.array([f"t{p}" if p % 5 else "\n" for p in range(39)], dtype=object)
        rows.append({**b, "condition": "tokens", "tokens": tokens, "new_tokens": np.array(["x", "y"], dtype=object)})
        rows += [{**b, "condition": "position", "position": float(p), "token": str(tokens[p]),
                  "in_field": p < 7, "is_aggregator": p % 5 == 0, "score": 0.0,
                  "recovery": float(RNG.normal(0.2 if p % 5 == 0 else 0.0, 0.05))} for p in range(5, 39)]
    return rows


def suffix_records() -> list[dict]:
    rows = []
    for i in range(N_ITEMS - 1):
        b = item_base(i) | {"n_downstream": 32}
        for k in (2, 5, 10, 20, 30, 50, 70, 90, 100):
            rows.append({**b, "condition": "suffix", "k": float(k), "n_positions": 1.0, "recovery": min(1, k / 25) + RNG.normal(0, 0.05)})
            rows.append({**b, "condition": "prefix", "k": float(k), "n_positions": 1.0, "recovery": 0.3 * (k >= 90) + RNG.normal(0, 0.05)})
        for band in ("early", "mid", "late", "all"):
            rows.append({**b, "condition": "band", "band": band, "recovery": RNG.uniform(0, 1)})
        for k in (1, 2, 4, 8, 16, 32):
            rows.append({**b, "condition": "topk", "k": float(k), "n_positions": float(k), "recovery": min(1, 0.1 * k)})
            rows += [{**b, "condition": "randomk", "k": float(k), "n_positions": float(k), "draw": float(d),
                      "recovery": RNG.normal(0.01, 0.02)} for d in range(3)]
        for seg, lo, hi, top in (("session", 0, 10, 0), ("policy", 10, 60, 1), ("rule", 60, 75, 2), ("task", 75, 100, 5)):
            rows.append({**b, "condition": "segment", "segment": seg, "start_pct": float(lo), "end_pct": float(hi),
                         "n_positions": 10.0, "effect_sum": 0.1, "effect_max": 0.05, "n_top": top, "top_k": 8})
    return [{**r, "score": 0.0} for r in rows]


def linear_records() -> list[dict]:
    rows = []
    for i in range(N_ITEMS):
        for which in ("old", "new"):
            commit = int(RNG.integers(3, LAYERS))
            rows.append({"condition": "prompt", "item_id": f"gated-polarity/{i}", "domain": DOMAINS[i % 3],
                         "template_id": f"t{i % 3}", "prompt": which, "label": "a", "label_index": 0,
                         "model_label_index": i % 2, "polarity": "if", "probe_pos": 30, "final_pick": "a",
                         "commit_layer": commit, "rel_commit": commit / (LAYERS - 1), "n_aggregators": 3})
    rows += [{"condition": "layer", "label": "truth", "token": "last_aggregator", "layer": layer,
              "rel_layer": layer / (LAYERS - 1), "accuracy": min(1.0, 0.5 + 0.15 * layer), "n_correct": 0,
              "n_prompts": 2 * N_ITEMS, "ci_lo": 0.4, "ci_hi": 1.0, "n_groups": 3} for layer in range(LAYERS)]
    for label, top in (("truth", 1.0), ("model", 0.8)):  # the model's own answer never reaches 0.9
        for agg in range(3):
            rows += [{"condition": "probe", "label": label, "aggregator": agg, "segment": "task",
                      "downstream_frac": 0.9 - 0.1 * agg, "layer": layer, "rel_layer": layer / (LAYERS - 1),
                      "accuracy": min(top, 0.5 + 0.12 * layer - 0.05 * agg), "ci_lo": 0.3, "ci_hi": 1.0,
                      "n_correct": 5, "n_prompts": 2 * N_ITEMS, "n_groups": 3} for layer in range(LAYERS)]
        rows += [{"condition": "probe_mean", "label": label, "layer": layer, "rel_layer": layer / (LAYERS - 1),
                  "accuracy": min(top, 0.45 + 0.1 * layer), "ci_lo": 0.3, "ci_hi": 1.0, "n_aggregators": 3,
                  "n_prompts": 2 * N_ITEMS, "n_groups": 3} for layer in range(LAYERS)]
    return rows


def knockout_records() -> list[dict]:
    rows = []
    for i in range(N_ITEMS - 1):
        b = item_base(i)
        rows.append({**b, "condition": "mass", "mass_field": 0.002, "mass_downstream": 0.5, "mass_sink": 0.3,
                     "mass_other": 0.1, "mass_self": 0.098})
        for variant, shift in (("decision", 0.0), ("after_notes", 0.3)):
            v = {"variant": variant}
            rev = {"top": 0.9 + shift + (1.5 if i == 0 else 0.0), "field": 0.0, "sink": 0.1}  # item 0 overshoots
            rows += [{**b, **v, "condition": c, "n_keys": 4.0, "reversion": x} for c, x in rev.items()]
            rows += [{**b, **v, "condition": "random_matched", "n_keys": 4.0, "draw": float(d), "distance_gap": 1.0,
                      "reversion": RNG.normal(0.05, 0.3)} for d in range(2)]
            for f in (0.05, 0.1, 0.25, 0.5, 1.0):
                rows.append({**b, **v, "condition": "dose", "fraction": f, "n_keys": 2.0,
                             "reversion": min(1.0, 2 * f) + shift + RNG.normal(0, 0.05)})
                rows += [{**b, **v, "condition": "dose_random", "fraction": f, "n_keys": 2.0, "draw": float(d),
                          "reversion": f + RNG.normal(0, 0.05)} for d in range(2)]
        for band, x in (("early", 0.0), ("mid", 0.3), ("late", 0.4), ("all", 1.0)):
            rows.append({**b, "variant": "decision", "condition": "band", "band": band, "n_keys": 4.0,
                         "reversion": x + RNG.normal(0, 0.3)})
        for k in (1, 2, 4, 8, 12, 16):
            rows += [{**b, "condition": "heads", "ranking": rk, "n_heads": float(k), "heads": "[(1, 0)]",
                      "recovery": min(1.0, 0.05 * k * (2 if rk == "effect" else 1))} for rk in ("attention", "effect")]
            rows += [{**b, "condition": "heads", "ranking": "random", "n_heads": float(k), "draw": float(d),
                      "heads": "[(0, 1)]", "recovery": RNG.normal(0, 0.02)} for d in range(2)]
    out = [{"score": 0.0, **r} for r in rows]
    for r in out:
        if "reversion" in r:
            r |= {"reverted": 0.5 <= r["reversion"] <= 1.5, "overshoot": r["reversion"] > 1.5, "away": r["reversion"] < 0}
    return out


def edit_rows(i: int, strategy: str, correct: bool, frac: float, extra: dict | None = None) -> dict:
    return {"item_id": f"gated/{i}", "domain": DOMAINS[i % 3], "template_id": "t", "n_tokens": 400,
            "strategy": strategy, "margin": 1.0, "usable_recovery": True, "usable_p_correct": i != 0,
            "score": 0.0, "score_stale": -2.0, "score_oracle": 2.0, "recovery": float(correct),
            "pick": "a", "oracle_pick": "a", "correct": correct, "recomputed": int(400 * frac),
            "recompute_fraction": frac, "seconds": frac, "oracle_seconds": 1.0, "time_ratio": frac, **(extra or {})}


def edit_records() -> list[dict]:
    strategies = {"stale": (False, 0.002), "oracle": (True, 1.0), "field_only": (False, 0.005),
                  "erratum": (True, 0.14), "selective_recompute@8": (True, 0.03), "cacheblend@15%": (False, 0.2),
                  "selective_copy@8": (True, 0.025), "selective_recompute_att@8": (False, 0.03)}
    rows = [edit_rows(i, s, c, f) for i in range(N_ITEMS) for s, (c, f) in strategies.items()]
    rows += [edit_rows(i, s, True, f, {"cot": True}) for i in range(N_ITEMS)
             for s, f in (("stale+cot", 0.0), ("oracle+cot", 1.0), ("field_only+cot", 0.005))]
    return rows


def ksweep_records() -> list[dict]:
    return [edit_rows(i, f"{v}/{rk}", k >= 4, 0.005 + k / 400, {"k": k, "variant": v, "ranking": rk})
            for i in range(N_ITEMS) for v in ("copy", "recompute") for rk in ("effect", "attention")
            for k in (0, 1, 2, 4, 8)]


def wording_records() -> list[dict]:
    return [edit_rows(i, s, s != "erratum_reevaluate" or i % 2 == 0, 0.1) for i in range(N_ITEMS)
            for s in ("erratum", "erratum_bare", "erratum_tagged", "erratum_reevaluate")]


def selfcheck_records() -> list[dict]:
    return [{"block": b, "dtype": "float32", "seam": k, "cosine": 0.98 + 0.0005 * k + RNG.normal(0, 0.001),
             "top1_agree": True, "kl": 0.01, "prefix_len": 60, "block_len": 100, "question_len": 19,
             "max_abs_diff_extend": 1e-5, "max_abs_diff_splice_full": 1e-5} for b in range(3) for k in (0, 1, 2, 4, 8)]


def gate_rows() -> list[dict]:
    return [{"kind": "gate", **r} for r in selfcheck_records() if r["seam"] in (0, 4)]


def compose_records() -> list[dict]:
    return gate_rows() + [
        {"kind": "fidelity", "item_id": f"skills/{i}", "domain": DOMAINS[i % 3], "seam": k,
         "cosine": 0.97 + 0.004 * min(k, 4) + RNG.normal(0, 0.002), "top1_agree": k > 0, "kl": 0.02,
         "decision": 1, "decision_ref": 1, "decision_agree": True, "n_tokens": 600, "n_blocks": 3,
         "block_len_mean": 180.0, "recomputed": 3 * k + 10, "correct_ref": True, "correct": True}
        for i in range(N_ITEMS) for k in (0, 1, 2, 4, 8, 16, 32)]


def scaling_records() -> list[dict]:
    rows = gate_rows()
    for length in (512, 1024, 2048):
        for r in range(3):
            for path, seam, sec in (("full", -1, length * 2e-4), ("transplant", 4, 0.02 + length * 2e-5),
                                    ("limit", -1, 0.01), ("transplant", 0, 0.015 + length * 2e-5)):
                rows.append({"kind": "timing", "path": path, "seam": seam, "repeat": r, "seconds": sec * (1 + 0.05 * r),
                             "peak_mb": 10.0, "first_token": 5, "length": length, "prefix_len": 20, "question_len": 20,
                             "kv_mb": 1.0, "store_mb": 1.0, "precompile_s": 0.1, "cosine": 0.99,
                             "first_token_agree": True, "threads": 1, "device": "cpu"})
    return rows


def agent_records() -> list[dict]:
    return gate_rows() + [
        {"kind": "turn", "scenario": f"sc{s}", "turn": t, "domain": DOMAINS[t % 3], "n_updates": 1, "n_tokens": 900,
         "n_tokens_inplace": 880, "new_tokens": 30, "decision": 1, "decision_full": 1, "decision_full_erratum": 1,
         "agree": bool(RNG.uniform() < 0.9), "agree_erratum": True, "cosine_erratum": 0.99, "kl_erratum": 0.01,
         "cosine_inplace": 0.95, "correct": True, "correct_full": True, "correct_full_erratum": True,
         "composed_s": 0.1, "full_s": 0.5 + 0.1 * t, "latency_ratio": 5.0 + t}
        for s in range(4) for t in range(3)]


def serving_records() -> list[dict]:
    rows = []
    for variant, hit, mu in (("edit", 0.01, 7.0), ("erratum", 0.985, 4.0), ("hoist", 0.9, 4.2)):
        for k, (phase, rate) in enumerate((("sequential", math.nan), ("poisson", 1.0), ("poisson", 2.0))):
            for i in range(8 if phase == "poisson" else 3):
                ttft = float(RNG.lognormal(mu, 0.3)) / 1000
                cancelled = variant == "edit" and phase == "poisson" and i >= 6  # censored at the cap
                rows.append({"phase": phase, "rate": rate, "variant": variant, "wall_s": 60.0, "n_planned": 8,
                             "phase_hit_tokens": hit * 8000, "phase_query_tokens": 8000.0, "phase_hit_rate": hit,
                             "index": i, "value": "new" if i % 2 == 0 else "old", "request_id": f"RQ-{k:02d}{i:04d}",
                             "arrival_s": float(i), "ttft_s": math.nan if cancelled else ttft,
                             "ttft_lower_s": 2 * ttft if cancelled else ttft, "latency_s": ttft + 0.1,
                             "status": "cancelled" if cancelled else "ok", "error": "", "decision": "escalate",
                             "expected": "escalate", "correct": True, "prompt_tokens": 8004.0,
                             "item_id": "gated/s0/L8000/0000/access", "length": 8000})
    return rows


def memory_records() -> list[dict]:
    rows = gate_rows()
    rows += [{"kind": "synthetic", "item_id": f"memory/{i}", "domain": "profile", "condition": "transplant_erratum",
              "reference": "full_new", "cosine": 0.99, "top1_agree": True, "kl": 0.01, "decision": 1,
              "decision_ref": 1, "decision_agree": True, "correct": i % 3 != 0, "correct_ref": True,
              "n_tokens": 500, "memory_len": 100, "recomputed": 30} for i in range(6)]
    rows += [{"kind": "locomo", "conversation": f"conv-{c}", "question_index": j, "category": 1, "question": "q",
              "gold": "a", "answer_full": "a", "answer_transplant": "a", "answer_agree": True,
              "f1_full": 0.5, "f1_transplant": 0.5 + (0.1 if j == 0 else 0.0), "cosine": 0.995, "top1_agree": True,
              "kl": 0.01, "memory_len": 900, "turns_in_memory": 40} for c in range(2) for j in range(5)]
    return rows


def distance_records() -> list[dict]:
    return [{**item_base(i), "item_id": f"gated/s0/L1200/D{d}/{i:04d}/{DOMAINS[i % 3]}", "pair_id": f"gated/{i}",
             "distance": d, "distance_tokens": d - 3, "delta": 2.0 / np.log2(d), "abs_delta": 2.0 / np.log2(d),
             "usable": i != 0, "field_only": 1 - np.log2(d) / 10 if i else math.nan,
             "notes_only": np.log2(d) / 10 if i else math.nan, "full_downstream": 1.0 if i else math.nan}
            for i in range(N_ITEMS) for d in (32, 64, 128, 256, 512, 1024)]


def localize_records() -> list[dict]:
    """Per item: its tokens and segments, and nested held-out sets (each row names what its k adds)."""
    segs = ["head"] * 5 + ["field"] * 2 + ["session"] * 8 + ["rule"] * 10 + ["request"] * 8 + ["task"] * 5 + ["answer_prefix"] * 2
    rows = []
    for i in range(N_ITEMS):
        b = item_base(i)
        toks = [f"w{p}" if p % 4 else "\n" for p in range(40)]
        rows.append({**b, "condition": "tokens", "tokens": toks, "segments": segs, "n_cached": 39})
        ranked = list(range(38, 6, -1))
        for k in range(1, len(ranked) + 1):
            rows.append({**b, "condition": "set", "ranking": "heldout", "band": "all", "draw": 0, "k": k,
                         "recovery": min(1.0, k / (4 + i)), "added": [ranked[k - 1]],
                         "added_segments": [segs[ranked[k - 1]]], "added_classes": ["content"],
                         "added_attended": [True], "n_ranked": len(ranked), "n_unaligned": 0})
    return rows


def blend_records() -> list[dict]:
    methods = [("full", "full", 1.0, 1.0), ("naive", "naive", 0.0, 0.0)]
    methods += [("seam", f"seam@{k}", k, k / 100) for k in (2, 8, 32)]
    methods += [(m, f"{m}@{r:g}", r, r) for m in ("cacheblend", "notes") for r in (0.05, 0.15, 0.3)]
    return [{"kind": "blend", "workload": w, "item_id": f"{w}/{i}", "method": m, "name": name,
             "setting": setting, "recompute_fraction": frac, "cosine": 0.9 + 0.1 * frac - 0.01 * i,
             "task_score": float((i + int(10 * frac)) % 2) if w == "skills" else 0.3 + 0.2 * frac}
            for w in ("skills", "locomo") for i in range(4) for m, name, setting, frac in methods]


JOBS = {
    "patching": ("probe", "gated", patching_records), "suffix": ("probe", "gated", suffix_records),
    "linear": ("probe", "gated-polarity", linear_records), "knockout": ("probe", "gated", knockout_records),
    "edit": ("experiment", "gated", edit_records), "ksweep": ("experiment", "gated", ksweep_records),
    "wording": ("experiment", "gated", wording_records), "selfcheck": ("experiment", "gated", selfcheck_records),
    "compose": ("experiment", "gated", compose_records), "compose_scaling": ("experiment", "gated", scaling_records),
    "agent": ("experiment", "gated", agent_records), "serving": ("experiment", "gated", serving_records),
    "memory": ("experiment", "gated", memory_records),
    "distance": ("experiment", "gated", distance_records),
    "blend": ("experiment", "gated", blend_records),
    "localize": ("experiment", "gated", localize_records),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for model in ("llama", "qwen"):
        for job, (kind, task, make) in JOBS.items():
            params = {"seam": 4} if job == "compose_scaling" else None
            write_run(root, job, model, "2026-01-02_00-00-00", make(), kind=kind, task=task, params=params)
    # an older run of the same question (replaced), a failed one (left out), a trigger-task run
    write_run(root, "patching", "llama", "2025-12-31_00-00-00", patching_records())
    write_run(root, "suffix", "llama", "2026-02-01_00-00-00", suffix_records(), status="failed")
    write_run(root, "patching", "llama", "2026-01-03_00-00-00", patching_records("gated-trigger"), task="gated-trigger")
    return root


@pytest.fixture(scope="module")
def frame(results) -> pd.DataFrame:
    return load.load(results)


@pytest.fixture(scope="module")
def drawn(frame, tmp_path_factory):
    """Every figure drawn once from the synthetic runs (figures/ next to a report)."""
    out = tmp_path_factory.mktemp("report") / "figures"
    return out, build_all(frame, out)


# --- load -------------------------------------------------------------------------------------


def test_load_is_tidy_with_run_columns(results, frame):
    for col in ("run_id", "job", "job_kind", "model", "task", "seed", "commit", "margin"):
        assert col in frame.columns
    assert set(frame["job"]) == set(JOBS)
    assert set(frame["model"]) == {"llama", "qwen"}
    runs = load.runs_table(results)
    assert "failed" not in set(runs["status"])  # the failed run is left out
    assert len(load.runs_table(results, include_incomplete=True)) == len(runs) + 1
    pat = frame[(frame["job"] == "patching") & (frame["model"] == "llama")]
    assert set(pat["task"]) == {"gated", "gated-trigger"}
    assert not pat["run_id"].str.contains("2025-12-31").any()  # the newest run of a question wins
    assert frame.loc[frame["job"] == "linear", "task"].eq("gated-polarity").all()
    comp = frame[(frame["job"] == "compose_scaling") & (frame["kind"] == "timing")]
    assert "device_record" in comp and comp["device_record"].eq("cpu").all()  # clash renamed


def test_load_without_config_or_meta_falls_back_on_the_path(tmp_path):
    p = write_run(tmp_path, "patching", "gemma", "2026-01-01_00-00-00", patching_records())
    (p / "config.yaml").unlink()
    (p / "meta.json").unlink()
    info = load.run_info(p, tmp_path)
    assert (info["job"], info["model"], info["job_kind"]) == ("patching", "gemma", "probe")
    assert info["run_id"] == "patching/gemma/2026-01-01_00-00-00"
    assert load.load(tmp_path / "nothing").empty


# --- aggregate --------------------------------------------------------------------------------


def test_mean_ci_agrees_with_the_library_bootstrap():
    x = RNG.normal(0.5, 0.2, 40)
    m, lo, hi, n = aggregate.mean_ci(x, n_boot=4000)
    m2, lo2, hi2, n2 = bootstrap_ci(x, n_boot=4000)
    assert n == n2 == 40 and m == pytest.approx(m2)
    assert lo == pytest.approx(lo2, abs=0.02) and hi == pytest.approx(hi2, abs=0.02)
    assert lo < m < hi


def test_mean_ci_edge_cases_keep_nan_out():
    assert aggregate.mean_ci([])[3] == 0 and math.isnan(aggregate.mean_ci([])[0])
    m, lo, hi, n = aggregate.mean_ci([0.3, float("nan")])
    assert (m, n) == (0.3, 1) and math.isnan(lo) and math.isnan(hi)
    assert aggregate.mean_ci([1.0, 1.0, 1.0])[1:3] == (1.0, 1.0)
    assert aggregate.mean_ci(pd.Series([True, False, None], dtype=object))[:1] == (0.5,)


def test_ci_table_counts_units_not_rows(frame):
    rk = frame[(frame["job"] == "suffix") & (frame["condition"] == "randomk") & (frame["model"] == "llama")]
    t = aggregate.ci_table(rk, "recovery", ["k"])
    assert (t["n"] == N_ITEMS - 1).all()  # three draws per item count once
    by = aggregate.ci_table(frame[frame["job"] == "patching"], "recovery", ["model", "domain", "condition"])
    assert {"model", "domain", "condition", "mean", "lo", "hi", "n"} <= set(by.columns)
    assert (by["lo"].fillna(-9) <= by["mean"] + 1e-12).all()


def test_wilson_and_write_depth():
    lo, hi = aggregate.wilson(0.9, 10)
    assert 0.5 < lo < 0.9 < hi <= 1.0
    layers = pd.DataFrame(linear_records()).query("condition == 'layer'")
    w, earliest, latest = aggregate.write_depth(aggregate.layer_accuracy(layers), 0.9)
    assert earliest <= w == pytest.approx(0.6)
    assert math.isnan(latest)  # 10 prompts cannot put the lower bound above 0.9: no latest depth
    many = aggregate.layer_accuracy(layers.assign(n_prompts=400))
    assert aggregate.write_depth(many, 0.9) == (pytest.approx(0.6),) * 3  # 0.95 over 400 prompts


def test_reference_holds_the_papers_numbers():
    ref = aggregate.reference()
    paper = ref["claims"]
    assert paper["field_only_recovery"]["values"]["llama-3.1-8b"] == -0.028
    assert paper["write_depth"]["values"]["qwen3-8b"] == 0.39
    assert paper["ttft_speedup_32000"]["values"]["qwen3-8b"] == 13.93
    assert set(claims.EXTRACTORS) <= set(paper)
    for cid, c in paper.items():
        assert c.get("figure") is None or c["figure"] in FIGURES, cid
        verdicts.band(c.get("target"))  # every target parses
        if c.get("measured_by") is not None:
            assert cid in claims.EXTRACTORS, f"{cid} is measured by {c['measured_by']} but has no extractor"


# --- figures ----------------------------------------------------------------------------------


def test_every_figure_is_drawn(drawn):
    folder, out = drawn
    assert not out.failed, out.failed
    assert not out.skipped, out.skipped
    assert set(out.made) == set(FIGURES)
    for name, paths in out.made.items():
        assert [p.suffix for p in paths] == [".png", ".pdf"], name
        for p in paths:
            assert p.exists() and p.stat().st_size > 5_000, p
    assert list(folder.glob("position_strip_*.html"))
    assert sorted(p.stem for p in folder.glob("*.png")) == sorted(FIGURES)  # every PNG, nothing else


def test_figures_skip_with_a_reason_when_runs_are_missing(frame, tmp_path):
    only_selfcheck = frame[frame["job"] == "selfcheck"]
    out = build_all(only_selfcheck, tmp_path)
    assert set(out.made) == {"seam_repair"} and not out.failed
    assert "suffix" in out.skipped["memoization_map"] and "serving" in out.skipped["serving"]
    with pytest.raises(Skip):
        from analysis.figures import memoization_map
        memoization_map.make(frame.iloc[:0], tmp_path)


def test_figures_cli(results, tmp_path, capsys):
    assert figures_cli.main(["--results", str(results), "--out", str(tmp_path), "--only", "agent", "ksweep"]) == 0
    assert (tmp_path / "agent.png").exists() and (tmp_path / "ksweep.pdf").exists()
    assert "made" in capsys.readouterr().out
    assert figures_cli.main(["--results", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2


@pytest.fixture
def finished(monkeypatch):
    """The figures a make() draws and saves, with their figure-level legend and layout."""
    from analysis import style

    figs, real = [], style.finish
    monkeypatch.setattr(style, "finish", lambda fig, *a, **k: figs.append(fig) or real(fig, *a, **k))
    return figs


@pytest.fixture
def captured(monkeypatch):
    """The figure a make() draws, kept open instead of saved."""
    from analysis import style

    figs = []
    monkeypatch.setattr(style, "finish", lambda fig, *a, **k: figs.append(fig) or [])
    yield figs
    for f in figs:
        style.plt.close(f)


def _visible(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_knockout_dose_keeps_attention_share_and_recovery_on_separate_axes(frame, captured, tmp_path):
    from analysis.figures import knockout_dose, knockout_heads

    knockout_heads.make(frame[frame["model"] == "llama"], tmp_path)
    labels = [ax.get_ylabel() for ax in _visible(captured[0])]
    assert not [y for y in labels if "attention" in y and "recovery" in y]
    assert any("attention" in y for y in labels) and any(y.startswith("recovery") for y in labels)
    assert "read heads" in " ".join(ax.get_title() for ax in captured[0].axes)
    knockout_dose.make(frame[frame["model"] == "llama"], tmp_path)
    assert "signed reversion" in " ".join(ax.get_title() for ax in captured[1].axes)
    ticks = " ".join(t.get_text() for ax in captured[1].axes for t in ax.get_xticklabels())
    assert "rev 3/4\nover 1" in ticks  # the overshooting item is counted apart from the reverted ones


def test_edit_frontier_draws_one_legend_and_keeps_oracle_strategies_off_the_line(frame, finished, tmp_path):
    from analysis.figures import edit_frontier

    edit_frontier.make(frame, tmp_path)
    fig = finished[0]
    assert not [ax for ax in fig.axes if ax.get_legend() is not None] and len(fig.legends) == 1
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(texts) == len(set(texts))
    assert not any("selective_copy" in t or t == "selective_recompute@8" for t in texts)  # named on the plot
    named = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert {"selective_copy@8", "selective_recompute@8"} <= named
    pts = pd.DataFrame({"strategy": ["stale", "selective_copy@8", "erratum", "oracle"],
                        "x": [0.0, 0.02, 0.14, 1.0], "mean": [0.0, 1.0, 0.9, 1.0]})
    assert list(edit_frontier.frontier(pts)["strategy"]) == ["stale", "erratum", "oracle"]


def test_edit_frontier_charges_cot_for_its_reasoning_and_leaves_out_empty_panels(frame, captured, tmp_path):
    from analysis.figures import edit_frontier

    ed = frame[frame["job"] == "edit"].copy()
    with_gen = ed.assign(generated_tokens=np.where(aggregate.to_float(ed["cot"]) > 0, 40.0, np.nan))
    costed, note = edit_frontier.with_cost(with_gen, frame)
    cot = costed[costed["strategy"] == "field_only+cot"]
    assert np.allclose(cot["cost"], 0.005 + 40 / 400) and note == ""
    costed, note = edit_frontier.with_cost(ed, frame)  # no count recorded: the cot_tokens budget
    assert np.allclose(costed.loc[costed["strategy"] == "field_only+cot", "cost"], 0.005 + 48 / 400)
    assert "upper bound" in note
    none_usable = ed["model"] == "qwen"
    ed.loc[none_usable, "usable_p_correct"] = False
    edit_frontier.make(ed, tmp_path)
    titles = [ax.get_title() for ax in _visible(captured[-1])]
    assert len(titles) == 3 and not any(t.startswith("qwen: P(correct)") for t in titles)


def test_memoization_map_shades_the_prompt_segments(frame, captured, tmp_path):
    from analysis.figures import memoization_map

    table = memoization_map.segment_table(frame[(frame["job"] == "suffix") & (frame["model"] == "llama")])
    assert list(table["segment"]) == ["session", "policy", "rule", "task"]
    assert table.set_index("segment")["top_share"].to_dict() == pytest.approx(
        {"session": 0.0, "policy": 1 / 8, "rule": 2 / 8, "task": 5 / 8})
    memoization_map.make(frame, tmp_path)
    texts = [t.get_text() for t in captured[0].axes[0].texts]
    assert "task 0.62" in texts and "rule 0.25" in texts


def test_probe_depth_shows_both_labels_and_why_no_write_depth(frame, captured, tmp_path):
    from analysis.figures import probe_depth

    probe_depth.make(frame[frame["model"] == "llama"], tmp_path)
    axes = _visible(captured[0])
    assert [ax.get_title().split(": ")[1].split(" (")[0] for ax in axes] == [
        "label = correct conclusion", "label = the model's own answer"]
    model_texts = " ".join(t.get_text() for t in axes[1].texts)
    assert "never reaches 0.9: best 0.80" in model_texts
    assert any("write depth" in t.get_text() for t in axes[0].get_legend().get_texts())


# --- report -----------------------------------------------------------------------------------


def test_claims_are_recomputed_from_records(frame):
    fo = claims.ours(frame, "field_only_recovery").set_index("model")
    recs = frame[(frame["job"] == "patching") & (frame["task"] == "gated") & (frame["condition"] == "field_only")]
    assert fo.loc["llama", "n"] == N_ITEMS - 1  # the skipped item is not a zero
    assert fo.loc["llama", "mean"] == pytest.approx(recs[recs["model"] == "llama"]["recovery"].mean())
    trig = claims.ours(frame, "trigger_only_recovery")
    assert list(trig["model"]) == ["llama"]  # only llama ran the trigger task
    p_err = claims.ours(frame, "erratum_p_correct").set_index("model")
    assert p_err.loc["qwen", "n"] == N_ITEMS - 1  # the item not usable for P(correct) is left out
    assert claims.ours(frame, "field_only_cot_p_correct")["mean"].eq(1.0).all()
    assert claims.ours(frame, "field_only_p_correct")["mean"].eq(0.0).all()  # CoT rows kept apart
    sp = claims.ours(frame, "ttft_speedup_500").set_index("model")
    assert sp.loc["llama", "mean"] > 1 and sp.loc["llama", "n"] == 3
    assert claims.ours(frame, "ttft_speedup_32000").empty  # no such length: absent, not zero
    hit = claims.ours(frame, "serving_hit_rate_erratum").set_index("model")
    assert hit.loc["llama", "mean"] == pytest.approx(0.985) and hit.loc["llama", "n"] == 750  # cache blocks
    p90 = claims.ours(frame, "serving_p90_ratio")
    assert (p90["mean"] > 5).all() and p90["note"].str.contains("censored").any()
    mem = claims.ours(frame, "memory_delta").set_index("model")
    assert mem.loc["llama", "mean"] == pytest.approx(0.02) and "LoCoMo" in mem.loc["llama", "note"]
    assert claims.ours(frame, "causal_scrubbing_note").empty  # no scrub run here: no data, not zero
    heads = claims.ours(frame, "heads_top_recovery").set_index("model")
    assert heads.loc["llama", "mean"] == pytest.approx(0.6)  # attention ranking at k = 12 heads
    assert claims.ours(frame, "heads_random_recovery")["mean"].abs().lt(0.1).all()
    assert report.ours is claims.ours and report.all_claims is claims.all_claims  # notebooks call report.*


def test_verdicts_are_plain_and_honest():
    approx0 = {"approx": 0.0, "tol": 0.1}
    assert verdicts.verdict(approx0, 0.01, -0.02, 0.04, 10) == "consistent"  # CI inside the band
    assert verdicts.verdict(approx0, 0.5, 0.4, 0.6, 10) == "differs: ours is higher"
    assert verdicts.verdict({"at_least": 1.16}, 0.9, 0.8, 1.0, 3) == "differs: ours is lower"
    assert verdicts.verdict(approx0, 0.05, -0.05, 0.15, 10) == "overlaps"  # mean inside, CI not: not consistent
    assert verdicts.verdict(approx0, 0.15, 0.05, 0.25, 10) == "overlaps"
    assert verdicts.verdict(approx0, 0.0, -2, 2, 4) == "overlaps: CI much wider than the band"
    # within one score step of the dtype (bf16: 1/16 logit) of zero: zero, never a non-zero effect
    assert verdicts.verdict({"at_least": 0.02}, 0.03, 0.021, 0.04, 10) == "consistent"
    assert verdicts.verdict({"at_least": 0.02}, 0.03, 0.021, 0.04, 10, zero_eps=0.05).startswith(
        "differs: ours is zero within one score step")
    assert verdicts.verdict(approx0, 0.03, 0.01, 0.04, 10, zero_eps=0.05).startswith("consistent: zero within")
    assert verdicts.verdict(approx0, math.nan, math.nan, math.nan, 0) == "no data"
    assert verdicts.verdict(approx0, math.nan, math.nan, math.nan, 16).startswith("differs: undefined")
    assert verdicts.verdict(None, 0.3, 0.2, 0.4, 5).startswith("for reference")
    assert "n=1" in verdicts.verdict(approx0, 0.0, math.nan, math.nan, 1)


def test_report_writes_claims_figures_and_runs(results, frame, drawn):
    figs, built = drawn
    out = figs.parent / "REPORT.md"
    text = report.render(frame, results, figs, out, built)
    out.write_text(text)
    assert "### field_only_recovery" in text and "Llama-3.1-8B -0.028" in text
    assert "![memoization_map](figures/memoization_map.png)" in text
    assert "*Not measured*" not in text  # every claim has its probe or experiment now
    assert "*No data*: no completed `scrub` run" in text  # causal scrubbing: none in these runs
    assert "## Runs" in text and "## Cross-check against summary.json" in text
    assert "DEVELOPMENT RUN" not in text  # no run lowered its margin
    assert "FAILED" not in text and "skipped" not in text.split("## Figures")[1]
    for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text):
        assert (out.parent / link).exists(), link


def test_report_flags_development_runs(tmp_path):
    write_run(tmp_path / "runs", "patching", "llama", "2026-01-01_00-00-00", patching_records(), margin=0.0)
    out = tmp_path / "R.md"
    assert report.main(["--results", str(tmp_path / "runs"), "--out", str(out), "--no-figures"]) == 0
    text = out.read_text()
    assert "Warning: 1 of the runs" in text and "DEVELOPMENT RUN" in text and "*No data*" in text


def test_library_never_imports_plotting():
    root = Path(__file__).resolve().parents[2] / "kvnotes"
    offenders = [str(p) for p in root.rglob("*.py")
                 if re.search(r"^\s*(import|from)\s+(matplotlib|analysis)\b", p.read_text(), re.M)]
    assert not offenders, f"plotting lives only in analysis/: {offenders}"


def test_reference_copy_takes_the_four_files_of_completed_runs_only(tmp_path):
    from analysis import reference

    run = tmp_path / "runs" / "edit" / "llama" / "2026-01-01_00-00-00"
    run.mkdir(parents=True)
    for f in reference.FILES:
        (run / f).write_text("{}")
    clean = {"status": "completed", "git": {"commit": "0123456789", "dirty": False}}
    (run / "meta.json").write_text(json.dumps(clean))
    seal(run)
    (run / "store").mkdir()
    dest = reference.copy_run(run, tmp_path / "ref")
    assert dest == tmp_path / "ref" / "edit" / "llama" / "2026-01-01_00-00-00"
    assert sorted(p.name for p in dest.iterdir()) == sorted(reference.FILES)
    assert "reference" not in json.loads((dest / "meta.json").read_text())  # a clean run is not marked
    (run / "meta.json").write_text(json.dumps({"status": "interrupted"}))
    with pytest.raises(ValueError, match="only completed runs"):
        reference.copy_run(run, tmp_path / "ref2")
    assert reference.main([str(tmp_path / "nowhere"), "--to", str(tmp_path / "ref3")]) == 2


def test_the_ttft_limit_is_the_fastest_of_its_timings_per_run_and_length():
    from analysis.figures.ttft_scaling import fastest_limit

    def row(run, length, path, seconds, repeat=0):
        return {"run_id": run, "length": length, "path": path, "seconds": seconds, "repeat": repeat, "seam": -1}

    t = pd.DataFrame([row("new", 512, "limit", 0.3), row("new", 512, "limit_engine", 0.2),  # engine faster
                      row("new", 4096, "limit", 1.0), row("new", 4096, "limit_engine", 2.0),  # bare faster
                      row("old", 512, "limit", 0.5), row("old", 512, "full", 9.0),  # an older run: bare only
                      row("3way", 512, "limit", 0.3), row("3way", 512, "limit_engine", 0.2),
                      row("3way", 512, "limit_inplace", 0.15)])  # a cache held in place: no copy
    out = fastest_limit(t).set_index(["run_id", "length", "path"])["seconds"]
    assert out[("new", 512, "limit")] == 0.2 and out[("new", 4096, "limit")] == 1.0
    assert out[("old", 512, "limit")] == 0.5 and out[("old", 512, "full")] == 9.0
    assert out[("3way", 512, "limit")] == 0.15
    assert len(out) == 5 and set(out.index.get_level_values("path")) == {"limit", "full"}


def test_ttft_speedups_show_min_max_over_repeats_not_a_bootstrap():
    from analysis.figures.ttft_scaling import speedups

    full = [4.0, 8.0, 12.0]  # transplant 2 s each: ratios 2, 4, 6
    rows = [{"length": 512, "path": "full", "seam": np.nan, "repeat": r, "seconds": s} for r, s in enumerate(full)]
    rows += [{"length": 512, "path": "transplant", "seam": 4, "repeat": r, "seconds": 2.0} for r in range(3)]
    rows += [{"length": 512, "path": "limit", "seam": np.nan, "repeat": r, "seconds": 1.0} for r in range(3)]
    sp = speedups(pd.DataFrame(rows), 4).set_index("path")
    assert tuple(sp.loc["transplant", ["mean", "lo", "hi", "n"]]) == (4.0, 2.0, 6.0, 3)
    assert tuple(sp.loc["limit", ["lo", "hi"]]) == (4.0, 12.0)
