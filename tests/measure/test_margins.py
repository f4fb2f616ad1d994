"""kvnotes.measure.margins: the margin rule, the recorded derivations, and analysis.margin on a control run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from kvnotes.measure import margins
from kvnotes.models.registry import get_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "model"


def test_rule_is_three_rms_rounded_up():
    d = margins.derive([0.1, -0.1, 0.1, -0.1] * 3, "float32")
    assert d.rms == pytest.approx(0.1) and d.margin == pytest.approx(0.3) and d.n_control == 12
    d = margins.derive([0.101] * 12, "float32")  # 0.303 rounds up, never down
    assert d.margin == pytest.approx(0.31)


def test_rule_never_goes_below_eight_dtype_steps():
    tiny = [0.001, -0.002] * 6
    assert margins.derive(tiny, "bfloat16").margin == pytest.approx(0.5)  # 8 x 1/16
    assert margins.derive(tiny, "float32").margin == pytest.approx(0.01)  # 3 x RMS, rounded up
    assert margins.score_step("torch.bfloat16") == 1 / 16


def test_rule_refuses_too_few_controls_and_unknown_dtypes():
    with pytest.raises(ValueError, match="at least 12"):
        margins.derive([0.1, float("nan")] * 6, "float32")
    with pytest.raises(ValueError, match="no score step"):
        margins.derive([0.1] * 12, "int8")


def test_describe_says_derived_or_by_hand(monkeypatch):
    d = margins.Derivation(margin=0.25, rms=0.08, n_control=48, dtype="float32", source="run X")
    monkeypatch.setattr(margins, "DERIVED", {"m": d})
    text = margins.describe("m", "float32", 0.25)
    assert text.startswith("margin 0.25: derived") and "0.08" in text and "run X" in text
    assert "this run is bfloat16" in margins.describe("m", "bfloat16", 0.25)
    assert "set by hand (the rule gives 0.25" in margins.describe("m", "float32", 1.0)
    assert "no derivation recorded" in margins.describe("other", "float32", 1.0)


def test_no_usable_hint_is_one_line_with_what_to_try():
    line = margins.no_usable_hint(48, 1.0, 0.82)
    assert "\n" not in line and "none of 48" in line and "0.82" in line
    assert "qwen-1.5b" in line and "analysis.margin" in line


def test_the_registry_reads_the_recorded_derivations():
    for path in sorted(CONFIGS.glob("*.yaml")):
        name = yaml.safe_load(path.read_text())["name"]
        want = margins.DERIVED[name].margin if name in margins.DERIVED else margins.HAND_MARGIN
        assert get_spec(name).margin == want == margins.margin_of(name), name


def _control_run(root: Path, deltas: list[float], suite: str = "gated-control", status: str = "completed") -> Path:
    run = root / "validate_tasks" / "llama" / "2026-01-01_00-00-00"
    run.mkdir(parents=True)
    cfg = {"model": {"name": "llama", "margin": 1.0}, "task": {"name": suite, "length": 400},
           "experiment": {"name": "validate_tasks"}, "seed": 0}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "meta.json").write_text(json.dumps({"status": status, "model_name": "llama", "dtype": "float32",
                                               "seed": 0, "git": {"commit": "abcdef0123", "dirty": False}}))
    old = np.linspace(-1, 1, len(deltas))
    pd.DataFrame({"score_old": old, "score_new": old + np.asarray(deltas)}).to_parquet(run / "records.parquet")
    return run


def test_analysis_margin_derives_from_a_control_run(tmp_path, capsys):
    from analysis import margin

    run = _control_run(tmp_path, [0.05, -0.05] * 24)
    model, d = margin.from_run(run)
    assert model == "llama" and d.margin == pytest.approx(0.15) and d.n_control == 48
    assert "gated-control" in d.source and "abcdef0" in d.source
    assert margin.main([str(run)]) == 0
    assert "margin: 0.15" in capsys.readouterr().out


def test_analysis_margin_refuses_other_runs(tmp_path):
    from analysis import margin

    run = _control_run(tmp_path, [0.05] * 12, suite="gated")
    with pytest.raises(ValueError, match="gated-control"):
        margin.from_run(run)
    assert margin.main([str(run)]) == 2
