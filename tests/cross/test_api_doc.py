"""docs/api.md runs: its python blocks, in order, as one script on the real default model."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import kvnotes

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_every_top_level_name_has_an_example():
    text = "".join(blocks())
    missing = [n for n in ("load", "Pair", "recoveries", "patch_map", "attribution_map", "knockout", "localize",
                           "linear_probe", "pairs_file", "EditableCache", "prefill_block", "splice", "transplant")
               if f"kv.{n}" not in text]
    assert not missing, f"docs/api.md has no example of {missing}"
    assert set(kvnotes.__all__) >= {"Pair", "patch_map", "recoveries", "attribution_map", "knockout", "localize"}


def test_the_examples_run_on_the_default_model(llama, capsys):
    scope: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error", kvnotes.UnusablePairWarning)  # the example pair is usable
        for code in blocks():
            exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102
    out = capsys.readouterr().out
    assert "spearman" in out and "p_random" in out and "field_only" in out
