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
