"""The house rules of docs/ARCHITECTURE.md, checked on the source: which folder may import which,
no module over about 400 lines, jobs found by their module convention, typed model parameters."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 410  # "about 400": a module past it is split by what it holds
ENTRY_FILES = {"experiments/run.py", "experiments/summarize.py"}  # the runner's documented commands
# folder -> top-level packages it must never import (statically, anywhere in a module)
FORBIDDEN = {
    "kvnotes": {"probes", "experiments", "runner", "analysis", "benchmarks", "hydra", "omegaconf"},
    "probes": {"experiments", "runner", "analysis", "benchmarks", "hydra", "omegaconf"},
    "experiments": {"runner", "analysis", "benchmarks"},
    "runner": {"analysis", "benchmarks"},
    "analysis": {"probes", "experiments", "runner", "benchmarks"},
}


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def imported(path: Path) -> set[str]:
    """Top-level package names a module imports, at any depth (function-level imports too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_layers_import_only_downwards(folder):
    bad = {rel(p): sorted(imported(p) & FORBIDDEN[folder]) for p in modules(folder)
           if rel(p) not in ENTRY_FILES}
    assert not {k: v for k, v in bad.items() if v}, f"{folder}/ reaches up or sideways"


def test_the_entry_files_only_hand_over_to_the_runner():
    for name in ENTRY_FILES:
        tree = ast.parse((ROOT / name).read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        assert not defs and imported(ROOT / name) <= {"runner", "sys"}, name


def test_import_scan_sees_function_level_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from experiments.run import cli\n    import hydra.core\n")
    assert imported(src) == {"experiments", "hydra"}


@pytest.mark.parametrize("folder", ["kvnotes", "probes", "experiments", "runner", "analysis", "benchmarks"])
def test_no_module_over_about_400_lines(folder):
    long = {rel(p): n for p in modules(folder) if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by what they hold: {long}"


def test_jobs_are_found_by_their_module_convention():
    from runner import jobs

    found = jobs.discover()
    for kind, package in jobs.PACKAGES.items():
        files = {p.stem for p in (ROOT / package).glob("*.py") if not p.stem.startswith("_")}
        job_files = {m.rsplit(".", 1)[1] for m in found if m.startswith(f"{package}.")}
        assert job_files == files - {"__init__", "run", "summarize"}, package
        for name in jobs.names(kind):
            entry = jobs.get(kind, name)
            assert entry.help and callable(entry.run), (kind, name)
            assert entry.config_cls is None or hasattr(entry.config_cls, "__dataclass_fields__")
    assert "patching" in jobs.names("probe") and "edit" in jobs.names("experiment")


def test_a_module_with_name_but_no_run_is_refused():
    import types

    from runner import jobs

    broken = types.ModuleType("probes.broken")
    broken.NAME = "broken"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="defines NAME .* and run"):
        jobs.entry_of(broken, "probe")
    assert jobs.entry_of(types.ModuleType("probes._helper"), "probe") is None


def annotation_of_model(fn: ast.FunctionDef) -> list[str]:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return [ast.unparse(a.annotation) for a in args if a.arg == "model" and a.annotation is not None]


@pytest.mark.parametrize("folder", ["probes", "runner"])
def test_model_parameters_are_typed(folder):
    loose = []
    for path in modules(folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and "Any" in annotation_of_model(node):
                loose.append(f"{rel(path)}:{node.lineno} {node.name}")
    assert not loose


def test_mypy_checks_every_def_of_the_library_jobs_and_runner():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert set(cfg["packages"]) >= {"kvnotes", "probes", "experiments", "runner"}
    assert cfg["disallow_untyped_defs"] is True and cfg["warn_unused_ignores"] is True
