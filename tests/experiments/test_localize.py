"""Experiment `localize`: held-out position rankings, alignment, nested sets, end to end on a tiny model."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra import compose
from tiny_runs import TINY, hydra_ready  # noqa: F401

import runner.main as runner
from experiments.localize import (
    heldout_order,
    heldout_orders,
    in_sample_order,
    position_keys,
    scan_ks,
    segment_names,
    token_class,
)
from experiments.shared.localize_summary import summarize_sets
from kvnotes.measure.metrics import smallest_k
from kvnotes.models.tiny import tiny_tokenizer
from kvnotes.tasks import build_suite
from runner.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def cfg(results: Path, *overrides: str):
    return compose("config", overrides=["+experiment=localize", f"results_dir={results}", *TINY, "progress=false",
                                        "task=gated", "task.n_items=3", "task.length=900", "experiment.margin=0",
                                        "experiment.ks=[1,2,8]", "experiment.k_scan=4", "experiment.n_boot=50",
                                        *overrides])


@functools.cache
def items():
    return build_suite("gated", tiny_tokenizer(), n_items=3, length=900)


def test_heldout_ranking_never_reads_the_items_own_map():
    keys = {"a": {10: "x", 11: "y", 12: "z"}, "b": {20: "x", 21: "y", 22: "z"}, "c": {30: "x", 31: "y"}}
    maps = {"a": {"x": 0.0, "y": 0.1, "z": 0.9}, "b": {"x": 0.8, "y": 0.1, "z": 0.0}, "c": {"x": 0.6, "y": 0.3}}
    groups = dict.fromkeys(maps, "gated")
    orders = heldout_orders(maps, keys, groups)
    assert orders["a"] == ([10, 11, 12], [])  # means over b, c: x 0.7, y 0.2, z 0.0; a's own z = 0.9 unused
    assert in_sample_order({10: 0.0, 11: 0.1, 12: 0.9}, [10, 11, 12])[0] == 12  # in sample it would lead
    changed = dict(maps, a={"x": -5.0, "y": 9.0, "z": 9.0})  # any own map: the same ranking
    assert heldout_orders(changed, keys, groups)["a"] == orders["a"]
    assert orders["c"] == ([30, 31], [])  # c has no z: nothing to rank there
    # another group never contributes; an item alone in its group gets no ranking
    split = heldout_orders(maps, keys, {"a": "g1", "b": "g1", "c": "g2"})
    assert "c" not in split and split["a"] == ([10, 11, 12], [])


def test_keys_no_other_item_has_are_unaligned():
    ranked, unaligned = heldout_order({1: ("rule", 5), 2: ("rule", 40)}, [{("rule", 5): 0.3}])
    assert ranked == [1] and unaligned == [2]


def test_positions_align_across_items_of_one_template():
    its = items()
    assert len({it.domain for it in its}) == 3  # different domains: different words and lengths
    tok = tiny_tokenizer()
    by_key = [{k: p for p, k in position_keys(it, it.n_tokens - 1).items()} for it in its]
    for key in [("answer_prefix", 0), ("answer_prefix", -1), ("turn_answer", 0), ("request", -1),
                ("task", -1), ("rule", 0), ("examples", 0)]:
        texts = {tok.decode([it.old_ids[m[key]]]) for it, m in zip(its, by_key, strict=True)}
        assert len(texts) == 1, (key, texts)  # the same frame token in every item
    # keys are unique per item and count from both ends of a segment
    it = its[0]
    keys = position_keys(it, it.n_tokens - 1)
    assert len(set(keys.values())) == len(keys)
    a, b = it.segments["request"]
    assert keys[a] == ("request", 0) and keys[b - 1] == ("request", -1)
    start = position_keys(it, it.n_tokens - 1, "start")
    assert start[b - 1] == ("request", b - 1 - a)
    # the field's segment starts after the field; nothing upstream is keyed
    assert min(keys) == it.field_span[1] and keys[it.field_span[1]][1] == 0
    assert it.n_tokens - 1 not in keys  # the decision token is not cached


def test_token_classes():
    it = items()[0]
    tok = tiny_tokenizer()
    text = [tok.decode([i]) for i in it.old_ids]
    down = range(it.field_span[1], it.n_tokens - 1)
    newline = next(p for p in down if text[p] == "\n")
    letter = next(p for p in down if text[p].isalpha())
    assert token_class(it, newline) == "aggregator" and token_class(it, letter) == "content"
    assert token_class(it, it.field_span[0]) == "content"  # the field value is content
    segs = segment_names(it)
    assert segs[it.field_span[0]] == "field" and segs[-1] == "answer_prefix"


def test_scan_nests_and_smallest_k():
    assert scan_ks(4, 20) == [1, 2, 3, 4, 8, 16, 20]
    assert scan_ks(64, 5) == [1, 2, 3, 4, 5]
    ranked = [7, 3, 9, 1, 5]
    sets = [set(ranked[:k]) for k in scan_ks(2, 5)]
    assert all(a < b for a, b in zip(sets, sets[1:], strict=False))  # strictly nested
    assert smallest_k([1, 2, 4, 8], [0.1, 0.85, 0.7, 0.9], 0.8) == 2  # the first, not a later one
    assert np.isnan(smallest_k([1, 2], [0.1, float("nan")], 0.8))  # none reaches it: NaN, not a sentinel


def test_paper_top8_is_the_reference_value():
    ref = yaml.safe_load((ROOT / "analysis" / "paper_reference.yaml").read_text())
    conf = yaml.safe_load((ROOT / "configs" / "experiment" / "localize.yaml").read_text())
    claims = ref.get("claims", ref)
    assert conf["paper_top8"] == claims["top8_recovery"]["values"]["paper"]


def _rows(item: str, recs: list[float], added: list[list[int]], segs: list[str], cls: list[str]):
    base = {"item_id": item, "condition": "set", "band": "all", "draw": 0, "n_ranked": 10, "n_unaligned": 2}
    out, i = [], 0
    for k, r, a in zip([1, 2, 3, 8], recs, added, strict=True):
        n = len(a)
        out.append(base | {"ranking": "heldout", "k": k, "recovery": r, "added": a, "added_segments": segs[i:i + n],
                           "added_classes": cls[i:i + n], "added_attended": [True] * n})
        i += n
    return out + [base | {"ranking": rk, "k": k, "recovery": 0.5} for rk in ("in_sample", "random") for k in (1, 8)]


def test_summary_recomputes_k80_and_its_set_from_records():
    segs = ["request", "task", "rule", "rule", "rule", "rule", "rule", "rule"]
    cls = ["content", "aggregator", *["content"] * 6]
    added = [[5], [6], [7], [8, 9, 10, 11, 12]]
    recs = _rows("a", [0.1, 0.85, 0.9, 0.95], added, segs, cls) + _rows("b", [0.0, 0.1, 0.2, 0.3], added, segs, cls)
    s = summarize_sets(recs, [1, 8], 0.8, [0.74, 0.79], n_boot=50)
    assert {"topk", "k80", "k80_set", "top8", "unaligned", "reading", "n_ranked_items"} <= set(s)
    assert s["k80"]["reached"]["k"] == 1 and s["k80"]["reached"]["n"] == 2
    assert s["k80"]["k"]["mean"] == 2.0  # item a: k = 2, the set {5, 6}
    assert s["k80_set"]["segments"]["request"]["mean"] == 0.5
    assert s["k80_set"]["aggregator_share"]["mean"] == 0.5
    assert set(s["topk"]) == {"heldout", "in_sample", "random"} and s["topk"]["heldout"][8]["n"] == 2
    assert s["top8"]["paper"] == [0.74, 0.79] and np.isclose(s["top8"]["heldout"]["mean"], 0.625)
    assert set(s["topk"]["heldout"][8]["quantiles"]) == {"q10", "q25", "q50", "q75", "q90", "n"}


def test_end_to_end_two_phases_and_a_summary(tmp_path, one_thread):
    run_dir = runner.run(cfg(tmp_path))
    rec = pd.read_parquet(run_dir / "records.parquet")
    pos = rec[rec["condition"] == "position"]
    assert pos["item_id"].nunique() == 3 and set(pos["band"]) == {"all"}
    sets = rec[rec["condition"] == "set"]
    held = sets[sets["ranking"] == "heldout"]
    for item, g in held.groupby("item_id"):  # the top-1 is the best key by the mean over the other items
        others = pos[pos["item_id"] != item].groupby("key")["recovery"].mean()
        mine = pos[(pos["item_id"] == item) & pos["key"].isin(others.index)]
        best = mine.assign(m=mine["key"].map(others)).sort_values(["m", "position"], ascending=[False, True])
        first = g[g["k"] == 1]["added"].iloc[0]
        assert list(first) == [int(best["position"].iloc[0])]
        ks = sorted(g["k"])
        assert ks[:4] == [1, 2, 3, 4] and ks[-1] == int(g["n_ranked"].iloc[0])
        added = [p for k in ks for p in g[g["k"] == k]["added"].iloc[0]]
        assert len(added) == len(set(added)) == ks[-1]  # nested: every k adds new positions only
    assert set(sets["ranking"]) == {"heldout", "in_sample", "random"}
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["n_usable"] == 3 and s["n_ranked_items"] == 3
    assert set(s["topk"]["heldout"]) == {"1", "2", "8"} and s["top8"]["heldout"]["n"] == 3


def test_bad_config_is_one_line_before_any_model_loads(tmp_path, monkeypatch):
    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(runner, "load", no_model)
    for bad in ("experiment.ks=[]", "experiment.ks=[0]", "experiment.align=middle", "experiment.group=rule",
                "experiment.threshold=1.5", "experiment.paper_top8=[0.8,0.7]"):
        with pytest.raises(ConfigError, match=r"^[^\n]+$"):
            runner.run(cfg(tmp_path, bad))
