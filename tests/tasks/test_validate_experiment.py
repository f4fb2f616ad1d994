"""`+experiment=validate_tasks` end to end on a tiny random model: records, summary, usable ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import runner.main as runner
from kvnotes.tasks import select_usable
from runner.context import load_items

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.name=tiny-qwen2", "model.tiny_family=qwen2", "progress=false"]


@pytest.fixture(scope="module", autouse=True)
def hydra_ready():
    runner.prepare()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


@pytest.mark.parametrize(("suite", "length"),  # the tiny tokenizer is character-level
                         [("gated", 700), ("gated-control", 700), ("skills", 2000), ("memory", 1000)])
def test_validate_tasks_writes_summary_and_usable_ids(tmp_path, suite, length):
    cfg = compose("config", overrides=["+experiment=validate_tasks", f"results_dir={tmp_path}",
                                       f"task={suite}", "task.n_items=3", f"task.length={length}",
                                       "experiment.margin=0.0", *TINY])
    run_dir = runner.run(cfg)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["n_items"] == 3 and s["margin"] == 0.0 and s["n_usable"] == 3  # margin 0: all
    assert {"accuracy_old", "accuracy_new", "flip_rate"} <= set(next(iter(s["per_domain"].values())))
    ids = json.loads((run_dir / "usable_ids.json").read_text())
    assert len(ids["recovery"]) == 3 and ids["model"] == "tiny-qwen2"
    model = runner.load(runner.validate(cfg).cfg)
    items = load_items(model, runner.validate(cfg).cfg)
    assert len(select_usable(items, run_dir / "usable_ids.json").items) == 3


def test_margin_defaults_to_the_model_config(tmp_path):
    cfg = compose("config", overrides=["+experiment=validate_tasks", f"results_dir={tmp_path}",
                                       "task=gated", "task.n_items=2", "task.length=700",
                                       "model.margin=1000.0", *TINY])
    s = json.loads((runner.run(cfg) / "summary.json").read_text())
    assert s["margin"] == 1000.0 and s["n_usable"] == 0
    assert s["skipped_recovery"] == {"small_delta": 2}
