"""Experiment `order` end to end on a tiny model: records per item and cell, the summary, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

import experiments.order as order
import runner.main as runner
from kvnotes.measure.metrics import wilson_ci
from kvnotes.tasks.order import cells
from runner.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.name=tiny-llama", "model.tiny_family=llama"]
STRETCHES = [160, 320]  # the tiny tokenizer spells the demonstrations and request in ~145 tokens


@pytest.fixture(scope="module", autouse=True)
def hydra_ready():
    runner.prepare()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


def cfg(results: Path, *overrides: str):
    return compose("config", overrides=["+experiment=order", f"results_dir={results}", *TINY,
                                        "task=gated-fresh", "experiment.n_items=2", "progress=false",
                                        "experiment.n_boot=50", f"experiment.stretches={STRETCHES}",
                                        *overrides])


def test_end_to_end_every_cell_in_the_summary(tmp_path, one_thread):
    run_dir = runner.run(cfg(tmp_path, "model.margin=0"))
    rec = pd.read_parquet(run_dir / "records.parquet")
    keys = [c.key for c in cells(STRETCHES)]
    assert len(rec) == 2 * len(keys) and sorted(rec["cell"].unique()) == sorted(keys)
    assert rec.groupby("pair_id")["cell"].nunique().eq(len(keys)).all()  # each item in every cell
    assert rec["usable"].all() and rec["skip_reason"].isna().all()  # margin 0
    assert np.allclose(rec["delta"], rec["score_oracle"] - rec["score_stale"])
    assert np.allclose(rec["full_downstream"], 1.0, atol=1e-3)  # field + everything after = oracle
    assert rec[["field_only", "notes_only"]].notna().all().all()
    assert (rec["stretch_tokens"] <= rec["stretch"]).all()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["n_items"] == 2 and s["margin"] == 0.0 and set(s["per_cell"]) == set(keys)
    assert "bootstrap over items" in s["intervals"]
    for k in keys:
        d = s["per_cell"][k]
        assert d["n"] == 2 and d["n_usable"] == 2
        for part in ("usable_share", "abs_delta", "field_only", "notes_only", "notes_minus_field"):
            assert {"mean", "ci_lo", "ci_hi", "n"} <= set(d[part]), (k, part)
        assert d["usable_share"]["ci_lo"] < 1.0 == d["usable_share"]["mean"]  # Wilson: never zero-width
        assert d["abs_delta"]["distribution"]["n"] == 2 and d["field_only"]["distribution"]["n"] == 2
        assert d["carrier"] == "undetermined" and d["predicted"] in ("field", "notes")  # 2 < MIN_USABLE
    assert set(s["per_order_content"]) == {"/".join(k.split("/")[:2]) for k in keys}
    assert f"order prompts up to {int(rec['n_tokens'].max())} tokens" in (run_dir / "run.log").read_text()


def test_unusable_items_keep_nan_recoveries_and_a_note(tmp_path, one_thread):
    run_dir = runner.run(cfg(tmp_path, "experiment.n_items=1", "experiment.stretches=[160]",
                             "experiment.margin=5"))
    rec = pd.read_parquet(run_dir / "records.parquet")
    assert len(rec) == 4 and not rec["usable"].any() and rec["field_only"].isna().all()
    assert rec["skip_reason"].str.contains("< margin 5").all()
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["per_cell"]["field_after_rule/filler/160"]["field_only"]["n"] == 0 and "no item is usable" in s["note"]


@pytest.mark.parametrize("bad, match", [
    ("experiment.stretches=[]", "stretches must be"),
    ("experiment.stretches=[64,64]", "stretches must be"),
    ("experiment.stretches=[0,256]", "stretches must be"),
    ("experiment.stretches=[64,9000]", "stretches must be"),
    ("experiment.n_items=0", "n_items must be"),
    ("experiment.content_at=middle", "content_at must be"),
    ("experiment.margin=-1", "margin must be"),
    ("experiment.stretches=[32,256]", "stretch 32 is below the"),
    ("task=gated-control", "variant field"),
])
def test_bad_config_is_one_line_before_any_forward(tmp_path, monkeypatch, bad, match):
    def boom(*a, **k):
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(order, "run_pairs", boom)
    with pytest.raises(ConfigError, match=match) as e:
        runner.run(cfg(tmp_path, bad))
    assert "\n" not in str(e.value)


def _row(pair: int, o: str, c: str, s: int, field: float, notes: float, usable: bool = True) -> dict:
    return {"pair_id": f"g/{pair}", "domain": f"d{pair % 3}", "order": o, "content": c, "stretch": s,
            "stretch_tokens": s - 3, "n_tokens": 400 + s, "margin": 1.0, "abs_delta": 2.0 if usable else 0.1,
            "usable": usable, "field_only": field if usable else math.nan,
            "notes_only": notes if usable else math.nan, "full_downstream": 1.0 if usable else math.nan}


def test_summary_carriers_and_verdicts():
    rows = []
    for i in range(14):  # after/filler: the field carries at both stretches, as H1 predicts
        rows += [_row(i, "field_after_rule", "filler", s, 0.8 + 0.01 * (i % 3), 0.1) for s in (64, 256)]
        # before/filler: the field carries too, against H1 (notes predicted)
        rows += [_row(i, "field_before_rule", "filler", s, 0.7 + 0.01 * (i % 2), 0.2) for s in (64, 256)]
    rows.append(_row(99, "field_after_rule", "filler", 64, 0, 0, usable=False))
    s = order.summarize(rows, order.OrderConfig(n_boot=200, stretches=[64, 256]))
    cell = s["per_cell"]["field_after_rule/filler/64"]
    p, lo, hi = wilson_ci(14, 15)
    assert (cell["usable_share"]["mean"], cell["usable_share"]["ci_lo"], cell["usable_share"]["ci_hi"]) == (p, lo, hi)
    assert cell["n"] == 15 and cell["n_usable"] == 14 and cell["abs_delta"]["n"] == 15
    assert cell["carrier"] == "field" and cell["predicted"] == "field"
    assert s["per_order_content"]["field_after_rule/filler"]["verdict"] == "as predicted"
    before = s["per_order_content"]["field_before_rule/filler"]
    assert before["carriers_by_stretch"] == ["field", "field"] and before["verdict"] == "against"
    assert not before["carrier_changes_with_stretch"]
    assert s["per_order_content"]["field_after_rule/filler"]["usable_share"]["n"] == 15  # items, not rows
    few = order.summarize(rows[:8], order.OrderConfig(n_boot=50, stretches=[64, 256]))
    assert few["per_cell"]["field_after_rule/filler/64"]["carrier"] == "undetermined"


def test_the_carrier_reads_the_wider_of_the_item_and_domain_intervals():
    """20 items of one domain favour the notes, 4 of another the field: over items the difference
    excludes 0, resampling the two domains it does not, and the carrier says neither."""
    rows = [_row(i, "field_before_rule", "task", 64, 0.3, 0.6 + 0.01 * (i % 3)) | {"domain": "a"} for i in range(20)]
    rows += [_row(i, "field_before_rule", "task", 64, 0.7, 0.2 + 0.01 * (i % 2)) | {"domain": "b"} for i in range(20, 24)]
    cell = order.summarize(rows, order.OrderConfig(n_boot=400, stretches=[64]))["per_cell"]["field_before_rule/task/64"]
    d = cell["notes_minus_field"]
    assert d["ci_lo"] > 0 and d["ci_cluster"]["n_clusters"] == 2 and d["ci_cluster"]["ci_lo"] < 0
    assert d["ci_cluster"]["mean"] == pytest.approx(d["mean"])
    assert cell["carrier"] == "neither"
    assert "cluster bootstrap over domains" in order.summarize(rows, order.OrderConfig(n_boot=50, stretches=[64]))["intervals"]
