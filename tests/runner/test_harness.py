"""A missing harness package is one `error:` line before Hydra or a model loads (issue 54): it was a
14-72-line traceback, scikit-learn's after the model had loaded."""

from __future__ import annotations

import importlib.util
import runpy
import sys
import tomllib
from pathlib import Path

import pytest

from runner import harness

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "pip install -e '.[harness]'"


def _without(monkeypatch, *modules: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in modules else real(name, *a, **k))


@pytest.mark.parametrize(("module", "dist"), [("hydra", "hydra-core"), ("sklearn", "scikit-learn"),
                                              ("pyarrow", "pyarrow"), ("matplotlib", "matplotlib"),
                                              ("httpx", "httpx")])
@pytest.mark.parametrize("entry", ["experiments.run", "experiments.summarize", "runner"])
def test_a_missing_harness_package_is_one_line_before_the_runner_imports(monkeypatch, capsys, module, dist, entry):
    _without(monkeypatch, module)
    monkeypatch.setitem(sys.modules, "runner.main", None)  # importing it first would raise ImportError
    monkeypatch.setitem(sys.modules, "runner.summarize", None)
    monkeypatch.setattr(sys, "argv", [entry, "+experiment=selfcheck"])
    for name in (entry, f"{entry}.__main__"):  # run fresh, as `python -m` runs it
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(SystemExit) as e:
        runpy.run_module(entry, run_name="__main__", alter_sys=False)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: the harness needs {dist}: {INSTALL}"


def test_the_runner_s_cli_checks_too(monkeypatch, capsys):
    import runner.main as runner_main

    _without(monkeypatch, "sklearn", "matplotlib")
    with pytest.raises(SystemExit) as e:
        runner_main.cli()
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: the harness needs matplotlib, scikit-learn: {INSTALL}"


def test_every_package_of_the_harness_extra_is_checked():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {r.split(">")[0].split("<")[0].split("=")[0].strip() for r in reqs}
    extra, core = names(project["optional-dependencies"]["harness"]), names(project["dependencies"])
    # every package of the extra, and the library's own that the harness imports (pandas, scikit-learn)
    assert extra <= set(harness.PACKAGES.values()) <= extra | core
    assert harness.missing() == []  # this environment has the harness
