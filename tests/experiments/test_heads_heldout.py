"""Experiment `heads_heldout`: the cross-fitted read-head ranking, end to end on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose
from tiny_runs import TINY, hydra_ready  # noqa: F401

import runner.main as runner
from experiments.heads_heldout import heldout_orders
from runner.config import ConfigError


def cfg(results: Path, *overrides: str):
    return compose("config", overrides=["+experiment=heads_heldout", f"results_dir={results}", *TINY, "progress=false",
                                        "task=gated", "task.n_items=3", "task.length=900", "experiment.margin=0",
                                        "experiment.head_ks=[1,2]", "experiment.n_heads=3",
                                        "experiment.n_random=1", *overrides])


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


def test_end_to_end_two_phases_and_a_summary(tmp_path, one_thread):
    run_dir = runner.run(cfg(tmp_path))
    rec = pd.read_parquet(run_dir / "records.parquet")
    single = rec[rec["condition"] == "head_single"]
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
    for bad in ("experiment.head_ks=[]", "experiment.head_ks=[0]", "experiment.n_random=-1"):
        with pytest.raises(ConfigError):
            runner.run(cfg(tmp_path, bad))
