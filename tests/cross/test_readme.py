"""The README's Python examples run as written; every relative link in the docs resolves."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


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


DOCS = ["README.md", "docs/ARCHITECTURE.md", "docs/paper.md", "docs/performance.md",
        "kvnotes/tasks/README.md", "results/reference/README.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    root = README.parent
    path = root / doc
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{doc}: links that resolve to nothing: {broken}"


def test_the_readme_stays_short_and_links_no_outside_file():
    text = README.read_text()
    assert len(text.splitlines()) <= 260  # about 250: a user reads it in five minutes
    assert "PAPER.md" not in text and "ANCHORS.md" not in text and "../shared" not in text


@pytest.mark.real
def test_pairs_example_runs(llama, capsys, monkeypatch):
    import kvnotes

    monkeypatch.setattr(kvnotes, "load", lambda *a, **k: llama)  # reuse the session's model
    exec(compile(_example("pairs"), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "field_only" in out and "notes_only" in out
