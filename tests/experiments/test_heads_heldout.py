"""Experiment `heads_heldout`: the cross-fitted read-head ranking, end to end on a tiny model."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose
from tiny_runs import ONE_THREAD, TINY, hydra_ready  # noqa: F401

import experiments.heads_heldout as heads_heldout
import runner.main as runner
from experiments.heads_heldout import heldout_orders
from runner.config import ConfigError
from runner.summarize import resummarize

FRESH = ["task.domains=[library,rental,hotel]", ONE_THREAD]  # vet's outcomes share a first tiny token


def cfg(results: Path, *overrides: str, task: str = "gated"):
    return compose("config", overrides=["+experiment=heads_heldout", f"results_dir={results}", *TINY, "progress=false",
                                        f"task={task}", "task.n_items=3", "task.length=900", "experiment.margin=0",
                                        "experiment.head_ks=[1,2]", "experiment.n_heads=3",
                                        "experiment.n_random=1", *overrides])


def fresh(results: Path, *overrides: str):
    """A frozen-transfer run's config: gated-fresh (never used to rank heads)."""
    return cfg(results, *FRESH, *overrides, task="gated-fresh")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A cross-fitted run on gated: the run the frozen tests freeze their heads on."""
    return runner.run(cfg(tmp_path_factory.mktemp("source"), ONE_THREAD))


def top(single: pd.DataFrame, column: str, n: int) -> list[tuple[int, int]]:
    """The n heads of largest mean `column` over items (ties layer-major), sorted as records store them."""
    mean = single.groupby(["layer", "head"])[column].mean().reset_index()
    mean["neg"] = -mean[column]
    best = mean.sort_values(["neg", "layer", "head"], kind="stable").head(n)
    return sorted((int(a), int(b)) for a, b in zip(best["layer"], best["head"], strict=True))


def test_heldout_ranking_leaves_the_item_out():
    # 3 items x 2 layers x 2 heads; head (1, 1) is best on item a alone, (0, 1) on the others
    eff = {"a": [0.0, 0.1, 0.2, 0.9], "b": [0.0, 0.8, 0.1, 0.2], "c": [0.1, 0.6, 0.0, 0.3]}
    single = [{"item_id": i, "layer": h // 2, "head": h % 2, "recovery": v}
              for i, vals in eff.items() for h, v in enumerate(vals)]
    orders = heldout_orders(single, 2, 2)
    assert orders["a"]["effect"][0] == (1, 1)  # in sample: the item's own best head
    assert orders["a"]["effect_heldout"][0] == (0, 1)  # mean over b, c: 0.7 for (0, 1)
    assert orders["b"]["effect_heldout"][:2] == [(1, 1), (0, 1)]  # over a, c: 0.6 and 0.35
    assert orders["b"]["effect"][0] == (0, 1)


def test_end_to_end_two_phases_and_a_summary(source):
    run_dir = source
    rec = pd.read_parquet(run_dir / "records.parquet")
    single = rec[rec["condition"] == "head_single"]
    assert single["attention_to_notes"].notna().all()  # what a frozen attention ranking needs
    n_heads = single.groupby("item_id").size()
    assert len(n_heads) == 3 and n_heads.nunique() == 1  # every head of every item, once
    heads = rec[rec["condition"] == "heads"]
    assert set(heads["ranking"]) == {"attention", "effect", "effect_heldout", "random"}
    assert sorted(heads["n_heads"].unique()) == [1, 2, 3]
    # the held-out top head of each item is the best by mean effect over the other two items
    mean = single.pivot_table(index=["layer", "head"], columns="item_id", values="recovery")
    for item, g in heads[(heads["ranking"] == "effect_heldout") & (heads["n_heads"] == 1)].groupby("item_id"):
        others = mean.drop(columns=item).mean(axis=1)
        layer, head = others.idxmax()
        assert g["heads"].iloc[0] == str([(int(layer), int(head))])
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["n_usable"] == 3 and s["n_curve_items"] == 3
    assert set(s["heads"]["curves"]) == {"attention", "effect", "effect_heldout", "random"}
    assert s["heldout_minus_attention_k3"]["n"] == 3 and s["effect_minus_heldout_k3"]["n"] == 3


def test_bad_config_is_one_line_before_any_forward(tmp_path):
    for bad in ("experiment.head_ks=[]", "experiment.head_ks=[0]", "experiment.n_random=-1",
                "experiment.frozen_from=''"):
        with pytest.raises(ConfigError):
            runner.run(cfg(tmp_path, bad))


def test_frozen_heads_tested_unranked_on_another_suite(source, tmp_path, one_thread):
    run_dir = runner.run(fresh(tmp_path, f"experiment.frozen_from={source}"))
    rec = pd.read_parquet(run_dir / "records.parquet")
    assert (rec["condition"] != "head_single").all()  # no single-head sweep on the frozen run
    heads = rec[rec["condition"] == "heads"]
    assert set(heads["ranking"]) == {"frozen_effect", "frozen_attention", "attention", "random"}
    assert heads["item_id"].nunique() == 3 and set(heads["suite"]) == {"gated-fresh"}
    run_id = "/".join(source.parts[-3:])
    assert set(rec["source_run"]) == {run_id} and not rec["in_source"].any()
    single = pd.read_parquet(source / "records.parquet").query("condition == 'head_single'")
    for rk, column in (("frozen_effect", "recovery"), ("frozen_attention", "attention_to_notes")):
        at3 = heads[(heads["ranking"] == rk) & (heads["n_heads"] == 3)]
        assert at3["heads"].nunique() == 1  # the same heads on every item: never re-ranked
        assert ast.literal_eval(at3["heads"].iloc[0]) == top(single, column, 3), rk
        assert ast.literal_eval(heads[(heads["ranking"] == rk) & (heads["n_heads"] == 1)]["heads"].iloc[0]) \
            == top(single, column, 1)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["frozen"]["source_run"] == [run_id] and s["frozen"]["frozen_from"] == str(source)
    assert s["frozen"]["heads"]["frozen_effect"] == [list(h) for h in top(single, "recovery", 3)]
    assert s["frozen"]["not_frozen"] == {} and s["frozen"]["n_items_in_source"] == 0
    for rk in ("frozen_effect", "frozen_attention", "attention", "random"):
        cell = s["recovery_k3"][rk]
        assert cell["n"] == 3 and {"ci_lo", "ci_hi"} <= set(cell) and cell["ci_cluster"]["cluster"] == "domain"
    for key in ("frozen_effect_minus_attention_k3", "frozen_effect_minus_random_k3",
                "frozen_attention_minus_attention_k3"):
        assert s[key]["n"] == 3, key
    want = heads[(heads["ranking"] == "frozen_effect") & (heads["n_heads"] == 3)].set_index("item_id")["recovery"] \
        - heads[(heads["ranking"] == "attention") & (heads["n_heads"] == 3)].set_index("item_id")["recovery"]
    assert s["frozen_effect_minus_attention_k3"]["mean"] == pytest.approx(want.mean())
    assert set(s["heads"]["curves"]) == {"frozen_effect", "frozen_attention", "attention", "random"}
    assert "best_single_head_mean" not in s["heads"]  # no single-head sweep: no NaN row in its place


def test_a_source_without_per_head_attention_freezes_the_effect_ranking_only(source, tmp_path, one_thread):
    old = tmp_path / "heads_heldout" / "tiny-llama" / "old-run"  # as the reference runs: no attention_to_notes
    shutil.copytree(source, old)
    rec = pd.read_parquet(old / "records.parquet")
    rec.drop(columns="attention_to_notes").to_parquet(old / "records.parquet")
    run_dir = runner.run(fresh(tmp_path / "runs", f"experiment.frozen_from={old}", "task.n_items=1",
                               "experiment.head_ks=[3]"))
    heads = pd.read_parquet(run_dir / "records.parquet").query("condition == 'heads'")
    assert set(heads["ranking"]) == {"frozen_effect", "attention", "random"}
    s = json.loads((run_dir / "summary.json").read_text())
    assert "attention_to_notes: not recorded there" in s["frozen"]["not_frozen"]["frozen_attention"]
    assert set(s["frozen"]["heads"]) == {"frozen_effect"} and "frozen_attention_minus_attention_k3" not in s


def test_the_source_is_read_once_and_not_needed_to_summarise_again(source, tmp_path, one_thread):
    """The config check before weights load and the run share one read of the source's records;
    summarising the frozen run again reads its own records only (the source may since have moved)."""
    moved = tmp_path / "heads_heldout" / "tiny-llama" / "moved"
    shutil.copytree(source, moved)
    before = heads_heldout._read_frozen.cache_info()
    run_dir = runner.run(fresh(tmp_path / "runs", f"experiment.frozen_from={moved}", "task.n_items=1",
                               "experiment.head_ks=[3]"))
    after = heads_heldout._read_frozen.cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits >= 1
    first = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(moved)
    again = resummarize(run_dir)
    for key in ("frozen", "recovery_k3"):  # as JSON: one item's interval ends are NaN
        assert json.dumps(again[key], sort_keys=True) == json.dumps(first[key], sort_keys=True), key


def _run_dir(path: Path, model: str, conditions: list[str]) -> str:
    path.mkdir(parents=True)
    (path / "meta.json").write_text(json.dumps({"model_name": model}))
    pd.DataFrame([{"item_id": "a", "condition": c, "layer": 0.0, "head": float(h), "recovery": 0.5}
                  for c in conditions for h in range(4)]).to_parquet(path / "records.parquet")
    return str(path)


@pytest.mark.parametrize("make, match", [
    (lambda p: str(p / "nowhere"), "is not a directory"),
    (lambda p: str(p), "has no records.parquet"),
    (lambda p: _run_dir(p / "r", "tiny-qwen", ["head_single"]), "is a run of model 'tiny-qwen', not 'tiny-llama'"),
    (lambda p: _run_dir(p / "r", "tiny-llama", ["heads"]), "has no head_single records"),
    (lambda p: _run_dir(p / "r", "tiny-llama", ["head_single"]), "per-head effects for 4 heads, fewer than n_heads=5"),
])
def test_a_bad_frozen_source_is_one_line_before_the_model_loads(tmp_path, monkeypatch, make, match):
    def boom(*a, **k):
        raise AssertionError("the model was loaded or a forward pass ran")

    monkeypatch.setattr(runner, "load", boom)
    monkeypatch.setattr(heads_heldout, "head_records", boom)
    source = make(tmp_path)
    with pytest.raises(ConfigError, match=match) as e:
        runner.run(fresh(tmp_path / "runs", f"experiment.frozen_from={source}", "experiment.n_heads=5"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists()  # refused before a run directory was opened
