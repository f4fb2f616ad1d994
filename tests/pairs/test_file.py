"""A prompts file: checked whole before any model loads, each line a Pair and a TaskItem; the CLI
runs the probes on it."""

from __future__ import annotations

import json

import pytest

from kvnotes.errors import ConfigError
from kvnotes.pairs import file

LINE = {"id": "a-1", "cluster": "a", "clean": [3, 4, 5, 6, 7, 8], "corrupt": [3, 9, 5, 6, 7, 8],
        "answers": [" a", " b"]}


def write(tmp_path, *objs, raw: str = ""):
    p = tmp_path / "pairs.jsonl"
    p.write_text("".join(json.dumps(o) + "\n" for o in objs) + raw)
    return p


def test_a_good_file_reads_with_ids_and_lines(tmp_path):
    second = {k: v for k, v in LINE.items() if k != "id"}
    rows = file.read_pairs_file(write(tmp_path, LINE, second))
    assert [r["id"] for r in rows] == ["a-1", "line-2"] and rows[1]["_line"] == 2


@pytest.mark.parametrize(("change", "want"), [
    ({"clean": ""}, "'clean' must be"),
    ({"answers": [" a"]}, "'answers' must be two strings"),
    ({"answers": [" a", "a"]}, "same word"),
    ({"metric": "logits"}, "valid: logit_diff"),
    ({"colour": 1}, "unknown key"),
    ({"spans": {"rule": 3}}, "'spans' must map"),
    ({"corrupt": "text"}, "the same way"),
])
def test_each_bad_line_is_one_error_naming_the_line(tmp_path, change, want):
    with pytest.raises(ConfigError, match=want) as e:
        file.read_pairs_file(write(tmp_path, LINE, LINE | change | {"id": "b"}))
    assert ":2:" in str(e.value) and "\n" not in str(e.value)


def test_file_level_refusals(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        file.read_pairs_file(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match="appears twice"):
        file.read_pairs_file(write(tmp_path, LINE, LINE))
    with pytest.raises(ConfigError, match=":2: not JSON"):
        file.read_pairs_file(write(tmp_path, LINE, raw="{nope\n"))
    with pytest.raises(ConfigError, match="holds no pairs"):
        file.read_pairs_file(write(tmp_path, raw="\n\n"))


def test_a_line_becomes_a_task_item_with_the_pairs_metric(tmp_path, tiny_llama_vocab):
    tok = tiny_llama_vocab.tokenizer
    clean = "Her badge is red. If the badge is red, reply Alpha; otherwise Beta. Reply:"
    obj = {"id": "x", "cluster": "badge", "clean": clean, "corrupt": clean.replace("red.", "blue.", 1),
           "answers": [" Alpha", " Beta"]}
    (item,) = file.load_pairs(write(tmp_path, obj), tok)
    assert item.suite == "pairs" and item.domain == "badge" and item.correct_new == "Alpha"
    assert item.metric is item.score_metric and item.metric.terms[0].vocab == item.score_ids
    assert item.old_text.endswith("Reply:") and item.meta["line"] == 1
