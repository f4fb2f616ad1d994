"""Experiment `distance` end to end on a tiny model: records, summary statistics, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

import experiments.distance as distance
import runner.main as runner
from kvnotes.measure.metrics import wilson_ci
from kvnotes.models import budget
from runner.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.name=tiny-llama", "model.tiny_family=llama"]


@pytest.fixture(scope="module", autouse=True)
def hydra_ready():
    runner.prepare()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


def cfg(results: Path, *overrides: str):
    return compose("config", overrides=["+experiment=distance", f"results_dir={results}", *TINY,
                                        "task=gated-fresh", "task.n_items=2", "progress=false",
                                        "experiment.n_boot=50", *overrides])


def test_end_to_end_one_record_per_item_and_distance(tmp_path, one_thread):
    run_dir = runner.run(cfg(tmp_path, "experiment.distances=[110,160]", "model.margin=0"))
    rec = pd.read_parquet(run_dir / "records.parquet")
    assert len(rec) == 4 and sorted(rec["distance"].unique()) == [110, 160]
    assert rec.groupby("pair_id")["distance"].nunique().eq(2).all()  # each item at both distances
    assert (rec["distance_tokens"] == rec["n_tokens"] - rec["field_end"]).all()
    assert rec["usable"].all()  # margin 0
    assert np.allclose(rec["delta"], rec["score_oracle"] - rec["score_stale"])
    assert np.allclose(rec["full_downstream"], 1.0, atol=1e-3)  # field + everything after = oracle
    assert rec[["field_only", "notes_only"]].notna().all().all()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["n_items"] == 2 and s["margin"] == 0.0 and set(s["per_distance"]) == {"110", "160"}
    d = s["per_distance"]["110"]
    assert d["n"] == 2 and d["n_usable"] == 2 and d["field_only"]["n"] == 2
    assert d["usable_share"]["ci_lo"] < 1.0 == d["usable_share"]["mean"]  # Wilson: never zero-width
    longest = int(rec["n_tokens"].max())  # the memory check reads these prompts, not task.length
    assert f"distance prompts up to {longest} tokens" in (run_dir / "run.log").read_text()


def test_unusable_items_keep_nan_recoveries_and_a_note(tmp_path, one_thread):
    run_dir = runner.run(cfg(tmp_path, "experiment.distances=[120]", "experiment.margin=5"))
    rec = pd.read_parquet(run_dir / "records.parquet")
    assert not rec["usable"].any() and rec["field_only"].isna().all()
    assert rec["skip_reason"].str.contains("< margin 5").all()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["per_distance"]["120"]["field_only"]["n"] == 0 and "no item is usable" in s["note"]


def test_bad_config_fails_before_any_forward(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(distance, "make_pair", boom)
    with pytest.raises(ConfigError, match="distance 8 is below"):
        runner.run(cfg(tmp_path, "experiment.distances=[8,200]"))
    for bad in ("experiment.distances=[]", "experiment.distances=[64,64]", "experiment.length=0",
                "experiment.distances=[64,9000]"):
        with pytest.raises(ConfigError):
            runner.run(cfg(tmp_path, bad))
    short = budget.ModelShape(450, 4, 4, 2, 16, 0, "config.json")  # task.length 400 passes
    monkeypatch.setattr(budget, "model_shape", lambda *a: short)
    with pytest.raises(ConfigError, match="exceed the 450 positions"):
        runner.run(cfg(tmp_path, "experiment.distances=[200]"))
    with pytest.raises(ConfigError, match="variant field"):
        runner.run(cfg(tmp_path, "task=gated-control", "task.n_items=1", "experiment.distances=[200]"))


def _row(pair: int, d: int, usable: bool, field: float, notes: float, delta: float = 2.0) -> dict:
    return {"item_id": f"g/L900/D{d}/{pair}", "pair_id": f"g/{pair}", "distance": d, "distance_tokens": d - 2,
            "margin": 1.0, "abs_delta": delta, "usable": usable,
            "field_only": field if usable else math.nan, "notes_only": notes if usable else math.nan,
            "full_downstream": 1.0 if usable else math.nan}


def test_summary_statistics():
    rows = [_row(0, 32, True, 0.8, 0.1), _row(1, 32, True, 0.6, 0.3), _row(2, 32, False, 0, 0, 0.2),
            _row(0, 512, True, 0.0, 0.9), _row(1, 512, False, 0, 0, 0.5), _row(2, 512, False, 0, 0, 0.1)]
    s = distance.summarize(rows, distance.DistanceConfig(n_boot=200))
    near, far = s["per_distance"]["32"], s["per_distance"]["512"]
    p, lo, hi = wilson_ci(2, 3)
    assert (near["usable_share"]["mean"], near["usable_share"]["ci_lo"], near["usable_share"]["ci_hi"]) == (p, lo, hi)
    assert near["field_only"]["mean"] == pytest.approx(0.7) and near["field_only"]["n"] == 2
    assert near["notes_minus_field"]["mean"] == pytest.approx(-0.5)
    assert far["notes_minus_field"]["mean"] == pytest.approx(0.9) and far["notes_minus_field"]["n"] == 1
    assert near["abs_delta"]["mean"] == pytest.approx((2 + 2 + 0.2) / 3) and near["abs_delta"]["n"] == 3
    assert s["n_items"] == 3 and s["margin"] == 1.0 and "note" not in s
