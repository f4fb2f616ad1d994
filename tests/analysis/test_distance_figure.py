"""Figure `distance`: one line per model, CIs, n, margin; recovery panels only with usable items."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from analysis import load
from analysis.figures import Skip, build_all
from analysis.figures import distance as figure


def _row(pair: int, d: int, usable: bool, field: float, notes: float, delta: float = 2.0) -> dict:
    return {"item_id": f"g/L900/D{d}/{pair}", "pair_id": f"g/{pair}", "distance": d, "distance_tokens": d - 2,
            "margin": 1.0, "abs_delta": delta, "usable": usable,
            "field_only": field if usable else math.nan, "notes_only": notes if usable else math.nan,
            "full_downstream": 1.0 if usable else math.nan}


def _write_run(root: Path, model: str, rows: list[dict]) -> None:
    path = root / "distance" / model / "2026-01-02_00-00-00"
    path.mkdir(parents=True)
    conf = {"model": {"name": model, "margin": 1.0}, "seed": 0, "task": {"name": "gated", "n_items": 3},
            "experiment": {"name": "distance", "margin": None}}
    (path / "config.yaml").write_text(yaml.safe_dump(conf))
    meta = {"kind": "experiment", "name": "distance", "model_name": model, "seed": 0, "status": "completed",
            "git": {"commit": "0123456789abcdef", "dirty": False}, "start_time": "2026-01-02_00-00-00"}
    (path / "meta.json").write_text(json.dumps(meta))
    pd.DataFrame([{"unit": f"u{i}", **r} for i, r in enumerate(rows)]).to_parquet(path / "records.parquet")
    (path / "summary.json").write_text(json.dumps({"kind": "experiment", "name": "distance", "model": model}))


def _rows(usable: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    return [_row(i, d, usable and (i + d) % 3 != 0, max(0.0, 1 - np.log2(d) / 8) + rng.normal(0, 0.05),
                 min(1.0, np.log2(d) / 8) + rng.normal(0, 0.05), 3.0 / np.log2(d))
            for i in range(3) for d in (32, 64, 128, 256, 512, 1024)]


def test_figure_draws_every_panel_with_n_and_margin(tmp_path):
    for model in ("llama", "qwen"):
        _write_run(tmp_path / "runs", model, _rows(True))
    frame = load.load(tmp_path / "runs")
    assert (frame["margin"] == 1.0).all()  # the run's margin is read from its config
    usable = figure.usable_share(frame.assign(_usable=frame["usable"].astype(bool)))
    assert set(usable["n"]) == {3} and ((usable["lo"] <= usable["mean"]) & (usable["mean"] <= usable["hi"])).all()
    paths = figure.make(frame, tmp_path / "fig")
    assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.stat().st_size > 5_000 for p in paths)


def test_figure_leaves_out_recovery_panels_without_usable_items(tmp_path, monkeypatch):
    _write_run(tmp_path / "runs", "llama", _rows(False))
    frame = load.load(tmp_path / "runs")
    seen = {}
    real = figure.style.panels

    def spy(n, **kw):
        seen["n"] = n
        return real(n, **kw)

    monkeypatch.setattr(figure.style, "panels", spy)
    figure.make(frame, tmp_path / "fig")
    assert seen["n"] == 2
    with pytest.raises(Skip, match="no completed run of experiment distance"):
        figure.make(frame[frame["job"] != "distance"], tmp_path / "fig")
    assert "distance" in build_all(frame, tmp_path / "all", only=["distance"]).made
