"""The house rules of docs/ARCHITECTURE.md, checked on the source: which folder may import which,
no module over about 400 lines, jobs found by their module convention, typed model parameters."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 410  # "about 400": a module past it is split by what it holds
ENTRY_FILES = {"experiments/run.py", "experiments/summarize.py"}  # the runner's documented commands
# folder -> top-level packages it must never import (statically, anywhere in a module)
FORBIDDEN = {
    "kvnotes": {"probes", "experiments", "runner", "analysis", "benchmarks", "serving", "hydra", "omegaconf"},
    "probes": {"experiments", "runner", "analysis", "benchmarks", "serving", "hydra", "omegaconf"},
    "serving": {"probes", "experiments", "runner", "analysis", "benchmarks", "hydra", "omegaconf"},
    "experiments": {"runner", "analysis", "benchmarks"},
    "runner": {"analysis", "benchmarks"},
    "analysis": {"probes", "experiments", "runner", "benchmarks", "serving"},
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


# The rooms of the library, lowest first: a room imports only rooms below it (and itself).
ROOMS = ["errors", "measure", "models", "engine", "tasks", "compose", "edit", "pairs", "cli", "__init__"]
# Where a model's forward may be called: the engine, plus the one load-time health check (a
# forward with no cache and no intervention, before any engine runs the weights; models sit
# below the engine, so it cannot go through it).
FORWARD_OWNER = "kvnotes/engine/"
FORWARD_EXCEPTIONS = {"kvnotes/models/loading.py:check_finite_logits"}


def room_of(module: str) -> str:
    """kvnotes.engine.run -> engine; kvnotes.errors -> errors; kvnotes -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def kvnotes_imports(path: Path) -> set[str]:
    """The kvnotes modules a module imports, at any depth; `from kvnotes.x import y` counts y
    when y is a module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "kvnotes"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "kvnotes":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = (ROOT / (sub.replace(".", "/") + ".py")).exists() or \
                    (ROOT / sub.replace(".", "/") / "__init__.py").exists()
                out.add(sub if is_module else node.module)
    return out


def test_library_rooms_import_only_downwards():
    rank = {r: i for i, r in enumerate(ROOMS)}
    bad = []
    for path in modules("kvnotes"):
        me = room_of(module_name(path))
        assert me in rank, f"{rel(path)}: a room not in ROOMS ({me}); add it in its place"
        for target in kvnotes_imports(path):
            if target != "kvnotes" and rank[room_of(target)] > rank[me]:
                bad.append(f"{rel(path)} -> {target}")
    assert not bad, f"upward imports inside kvnotes: {bad}"


def test_no_import_cycles_inside_kvnotes():
    graph = {module_name(p): {t for t in kvnotes_imports(p) if t != "kvnotes"} for p in modules("kvnotes")}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package's __init__ importing its own modules is not a cycle with them
    cycles = [c for c in cycles if not any(m.startswith(c.split(" -> ")[0] + ".") for m in c.split(" -> "))]
    assert not cycles, f"import cycles: {cycles}"


def forward_calls(path: Path) -> list[str]:
    """`<fn>:<line>` of every call of a model's forward: `x.hf(...)`, `x.hf.generate/forward(...)`,
    `x.adapter.decoder(...)(...)`, `x.nnsight.trace(...)`."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)] or [tree]:
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            text = ast.unparse(f)
            if (isinstance(f, ast.Attribute) and f.attr == "hf") or \
                    text.endswith((".hf.generate", ".hf.forward", ".nnsight.trace")) or \
                    (isinstance(f, ast.Call) and ast.unparse(f.func).endswith(".decoder")):
                out.append(f"{getattr(fn, 'name', '<module>')}:{node.lineno}")
    return out


@pytest.mark.parametrize("folder", ["kvnotes", "probes", "experiments", "runner", "serving", "analysis", "benchmarks"])
def test_only_the_engine_calls_a_models_forward(folder):
    found = []
    for path in modules(folder):
        if rel(path).startswith(FORWARD_OWNER):
            continue
        for call in forward_calls(path):
            if f"{rel(path)}:{call.split(':')[0]}" not in FORWARD_EXCEPTIONS:
                found.append(f"{rel(path)}:{call}")
    assert not found, f"a model's forward outside {FORWARD_OWNER}: {found}"


def test_the_forward_scan_sees_every_kind_of_call(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f(model, x):\n    model.hf(input_ids=x)\n    model.hf.generate(x)\n"
                   "    model.adapter.decoder(model.hf)(x)\n    with model.nnsight.trace(x):\n        pass\n")
    assert len(forward_calls(src)) == 4


def test_the_attention_switch_is_in_one_place():
    writes = []
    for path in modules("kvnotes"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "_attn_implementation" for t in node.targets):
                writes.append(rel(path))
    # the engine's switch, and the tiny configs' build-time choice (a fresh config, not a switch)
    assert set(writes) <= {"kvnotes/engine/run.py", "kvnotes/models/tiny.py"}, writes
    assert writes.count("kvnotes/engine/run.py") == 2  # set, then restore, in attention_impl


def test_the_entry_files_only_hand_over_to_the_runner():
    for name in ENTRY_FILES:
        tree = ast.parse((ROOT / name).read_text())
        defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)]
        assert not defs and imported(ROOT / name) <= {"runner", "sys"}, name


def test_import_scan_sees_function_level_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from experiments.run import cli\n    import hydra.core\n")
    assert imported(src) == {"experiments", "hydra"}


@pytest.mark.parametrize("folder", ["kvnotes", "probes", "experiments", "runner", "serving", "analysis", "benchmarks"])
def test_no_module_over_about_400_lines(folder):
    """The cap measures rooms, not files: a module may pass it when splitting would cut one
    responsibility in two, and its docstring says so (`Past the line cap: <why>`)."""
    long = {rel(p): n for p in modules(folder) if (n := len(p.read_text().splitlines())) > MAX_LINES
            and not past_the_cap(p)}
    assert not long, f"split these by what they hold, or say in the docstring why not: {long}"


def past_the_cap(path: Path) -> str:
    """The reason a module's docstring gives for passing the line cap ('' if none)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"Past the line cap: (\S.{20,})", doc.replace("\n", " "))
    return m.group(1) if m else ""


def test_a_module_past_the_cap_must_give_a_reason(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('"""A module.\n\nPast the line cap: its parser and its checks read one grammar."""\n')
    assert past_the_cap(src).startswith("its parser")
    src.write_text('"""A module. Past the line cap: yes."""\n')  # no reason given
    assert not past_the_cap(src)


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
    assert set(cfg["packages"]) >= {"kvnotes", "probes", "experiments", "runner", "serving"}
    assert cfg["disallow_untyped_defs"] is True and cfg["warn_unused_ignores"] is True


def test_no_job_module_is_imported_as_a_library():
    """What jobs share lives in experiments/shared, probes/parts, serving/ or the library: a
    module that defines a job is imported only by the runner's discovery (and by tests)."""
    from runner import jobs

    job_modules = set(jobs.discover())
    found = []
    for folder in ("kvnotes", "probes", "experiments", "serving", "analysis", "benchmarks", "runner"):
        for path in modules(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                found += [f"{rel(path)}: {n}" for n in names if n in job_modules and n != module_name(path)]
    assert not found, found


# tests/<room or package>/test_<module>.py; the checks of the whole repository sit in tests/cross/
TEST_FOLDERS = {"engine", "edit", "compose", "measure", "models", "tasks", "pairs", "probes", "experiments",
                "runner", "analysis", "benchmarks", "cross", "fixtures"}


def test_tests_mirror_the_packages():
    tests = ROOT / "tests"
    flat = sorted(p.name for p in tests.glob("test_*.py"))
    assert not flat, f"test files outside a package folder (tests/<package>/): {flat}"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders <= TEST_FOLDERS, f"test folders that name no package: {sorted(folders - TEST_FOLDERS)}"
    rooms = {p.name for p in (ROOT / "kvnotes").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert rooms <= TEST_FOLDERS, f"library rooms without a test folder: {sorted(rooms - TEST_FOLDERS)}"


RUN_FILE_NAMES = {"summary.json", "meta.json", "records.parquet", "config.yaml", "command.txt", "run.log",
                  "overrides.yaml", ".holder.json"}


def test_run_dir_files_are_spelled_in_one_module():
    """kvnotes.measure.runfiles names every file of a run dir; no other module spells one as a string."""
    owner = ROOT / "kvnotes" / "measure" / "runfiles.py"
    spelled = {}
    for folder in ("kvnotes", "runner", "analysis", "experiments", "benchmarks", "probes", "serving", "scripts"):
        for path in modules(folder):
            if path == owner:
                continue
            hits = sorted({n.value for n in ast.walk(ast.parse(path.read_text(), str(path)))
                           if isinstance(n, ast.Constant) and n.value in RUN_FILE_NAMES})
            if hits:
                spelled[rel(path)] = hits
    assert not spelled, f"run-dir file names spelled outside kvnotes/measure/runfiles.py: {spelled}"
