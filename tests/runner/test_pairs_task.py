"""task=pairs: the CLI on a user's prompts file (tiny random llama, token-id prompts), and its
refusals before any model loads."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from hydra import compose
from tiny_runs import ONE_THREAD, TINY, hydra_ready, read  # noqa: F401

import runner.context as runner_context
import runner.main as runner
from runner.config import ConfigError


def pairs_file(tmp_path, n: int = 3):
    lines = []
    for i in range(n):
        base = [20 + (7 * i + j) % 100 for j in range(30)]
        corrupt = list(base)
        corrupt[4] = base[4] + 1
        answers = [" a", " b"] if i % 2 else [" ab", " cd"]  # one token each, or teacher-forced pieces
        lines.append({"id": f"p{i}", "cluster": f"c{i % 2}", "clean": base, "corrupt": corrupt, "answers": answers})
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


@pytest.mark.parametrize("probe", ["patching", "attribution", "knockout"])
def test_probes_run_on_a_prompts_file_with_cluster_intervals(tmp_path, probe):
    path = pairs_file(tmp_path)
    cfg = compose("config", overrides=[f"+probe={probe}", "task=pairs", f"task.path={path}",
                                       f"results_dir={tmp_path / 'runs'}", "probe.margin=0.0", "progress=false",
                                       ONE_THREAD, *TINY] + (["probe.head_ks=[1,2]"] if probe == "knockout" else []))
    run_dir = runner.run(cfg)
    summary, records = read(run_dir / "summary.json"), pd.read_parquet(run_dir / "records.parquet")
    assert summary["n_items"] == 3 and summary["n_usable"] == 3
    assert set(records.suite) == {"pairs"} and set(records.domain) == {"c0", "c1"}
    assert set(records.item_id) == {"p0", "p1", "p2"}
    if probe == "patching":
        assert "ci_cluster" in summary["recovery"]["notes_only"]
    if probe == "knockout":  # the read heads and the every-later-query variant read teacher-forced answers too
        assert {"heads", "top"} <= set(records.condition) and "after_notes" in set(records.variant.dropna())


def test_a_bad_prompts_file_fails_before_the_model_loads(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model must not load")
    monkeypatch.setattr(runner_context, "load", no_load)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"clean": "a", "corrupt": "b"}) + "\n")
    for path, want in ((tmp_path / "none.jsonl", "does not exist"), (bad, "'answers' is required")):
        with pytest.raises(ConfigError, match=want):
            runner.run(compose("config", overrides=["+probe=patching", "task=pairs", f"task.path={path}",
                                                    f"results_dir={tmp_path / 'runs'}", *TINY]))
    assert not (tmp_path / "runs").exists()
