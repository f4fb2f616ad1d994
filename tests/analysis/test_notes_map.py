"""analysis.notes_map --method attribution|exact on a hand-made run folder: which column each draws,
and a patching run (no attribution column) refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from analysis import notes_map

TOKENS = ["a", "b", "c", "d", "e"]


def run_dir(tmp_path, attribution: bool):
    base = {"item_id": "i0", "domain": "d", "field_start": 1, "field_end": 2, "score_stale": 0.0, "score_oracle": 2.0}
    rows = [base | {"condition": "tokens", "tokens": TOKENS}]
    for p, exact, attr in ((1, 0.1, 0.3), (2, 0.7, 0.2), (3, float("nan"), 0.9)):
        rows.append(base | {"condition": "position", "position": p, "recovery": exact}
                    | ({"attribution": attr} if attribution else {}))
    (tmp_path / "records.parquet").parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(tmp_path / "records.parquet")
    (tmp_path / "meta.json").write_text(json.dumps({"model_name": "tiny"}))
    return tmp_path


@pytest.mark.parametrize("method, values", [("exact", [0.0, 0.1, 0.7, 0.0, 0.0]),
                                            ("attribution", [0.0, 0.3, 0.2, 0.9, 0.0])])
def test_method_picks_the_map(tmp_path, method, values):
    run = run_dir(tmp_path, attribution=True)
    records = pd.read_parquet(run / "records.parquet")
    tokens, rec, span, info = notes_map.item_map(records, "i0", method)
    assert tokens == TOKENS and span == (1, 2) and list(rec) == pytest.approx(values)
    assert notes_map.main(["--run", str(run), "--method", method, "--out", str(tmp_path / "fig")]) == 0
    stem = "notes_map_" + ("" if method == "exact" else "attribution_") + "i0"
    page = (tmp_path / "fig" / f"{stem}.html").read_text()
    assert f"Notes map ({method})" in page and f"recovery {values[3]:.3f}" in page
    assert (tmp_path / "fig" / f"{stem}.png").is_file()


def test_patching_run_has_no_attribution_map(tmp_path):
    run = run_dir(tmp_path, attribution=False)
    with pytest.raises(SystemExit, match="no attribution map"):
        notes_map.main(["--run", str(run), "--method", "attribution"])
    with pytest.raises(ValueError, match="valid: exact, attribution"):
        notes_map.item_map(pd.read_parquet(run / "records.parquet"), "i0", "linear")


def test_titles_omit_the_conditions_a_run_does_not_have():
    info = {"item_id": "i0", "method": "attribution", "field_only": float("nan"), "full_downstream": float("nan")}
    page = notes_map.to_html(TOKENS, np.zeros(5), (1, 2), info, "tiny")
    assert "nan" not in page and "field-only" not in page
    page = notes_map.to_html(TOKENS, np.zeros(5), (1, 2), info | {"field_only": 0.01, "full_downstream": 1.0}, "tiny")
    assert "field-only 0.010, full-downstream 1.000" in page
