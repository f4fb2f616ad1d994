"""The README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _example(name: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- example: {name} .*?-->\s*```python\n(.*?)```", text, re.S)
    assert m, f"README has no example {name!r}"
    return m.group(1)


@pytest.mark.real
def test_editable_example_runs(llama, capsys, monkeypatch):
    import kvnotes.models

    monkeypatch.setattr(kvnotes.models, "load_model", lambda *a, **k: llama)  # reuse the session's model
    exec(compile(_example("editable"), "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert "tokens recomputed of" in out[0] and len(out) >= 2
