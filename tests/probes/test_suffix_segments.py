"""Probe suffix's segment readout: where the individually effective positions sit in the prompt."""

import numpy as np
import pytest

from kvnotes import tasks
from kvnotes.models.tiny import tiny_model
from probes import suffix


@pytest.fixture(scope="module")
def item():
    return tasks.build_suite("gated", tiny_model("llama").tokenizer, chat=False, n_items=1, length=700, seed=0)[0]


def test_segments_partition_the_span_and_find_where_the_effect_is(item):
    down = list(range(item.field_span[1], item.n_tokens - 1))
    task = item.segments["task"]
    effect = np.array([1.0 if task[0] <= p < task[1] else 0.0 for p in down])
    top = [p for p in down if task[0] <= p < task[1]][:8]
    rows = suffix.segment_records(item, down, effect, top, [50, 70, 100])
    seg = {r["segment"]: r for r in rows if r["condition"] == "segment"}
    assert sum(r["n_positions"] for r in seg.values()) == len(down)
    assert seg["task"]["n_top"] == 8 and seg["task"]["effect_sum"] == task[1] - task[0]
    assert seg["session"]["start_pct"] == 0 and max(r["end_pct"] for r in seg.values()) == 100
    where = next(r for r in rows if r["condition"] == "top_positions")
    assert where["top_within_first_100"] == 1.0
    assert where["top_within_first_70"] == (1.0 if seg["task"]["end_pct"] <= 70 else 0.0)
    assert suffix.segment_records(item, down, np.full(len(down), np.nan), top, [70]) == []


def test_summary_explains_the_prefix_curve(one_thread):
    model = tiny_model("llama")
    items = tasks.build_suite("gated", model.tokenizer, chat=False, n_items=2, length=700, seed=0)
    cfg = suffix.SuffixConfig(margin=0.0, top_k=[1], n_random=1)
    s = suffix.summarize(suffix.run(model, items, cfg), cfg)
    names = [x["segment"] for x in s["segments"]]
    assert names.index("session") < names.index("policy") < names.index("request") < names.index("task")
    assert s["prefix_explained"].startswith("the first 70 % of the downstream span covers")
    assert set(s["top_within_first_pct"]) == set(suffix.K_PERCENT)


def test_segment_intervals_do_not_depend_on_the_hash_seed(tmp_path):
    """The per-item shares are bootstrapped in record order: a set of item ids iterates in an order
    that changes with PYTHONHASHSEED, which moved the reference CIs between two summaries."""
    import json
    import subprocess
    import sys

    rows = [{"condition": "segment", "item_id": f"gated/s0/{i:04d}", "segment": "task", "start_pct": 50.0,
             "end_pct": 100.0, "n_positions": 10, "n_top": i % 5, "top_k": 8, "effect_sum": 0.1 * i}
            for i in range(40)]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    code = ("import json, sys; from probes import suffix; rows = json.load(open(sys.argv[1]));"
            "cfg = suffix.SuffixConfig(n_boot=500);"
            "print(json.dumps(suffix.summarize_segments(rows, cfg)['segments'][0]['top_share']))")
    out = set()
    for seed in ("1", "2", "3"):
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
        out.add(subprocess.run([sys.executable, "-c", code, str(tmp_path / "rows.json")], env=env,
                               capture_output=True, text=True, check=True).stdout)
    assert len(out) == 1, out
