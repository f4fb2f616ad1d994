"""pyproject.toml against the imports (an AST scan): the wheel requires what kvnotes/ imports,
the harness extra what only the harness imports, and nothing else hides in either list.

`pip install kvnotes` used to bring hydra-core, matplotlib, scikit-learn, pandas, pyarrow and
httpx, which nothing in kvnotes/ imports (issue #34).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ("runner", "experiments", "probes", "analysis", "serving", "benchmarks")
OURS = {"kvnotes", *HARNESS, "tests", "scripts"}
# imported by code that runs in its own environment, not this package's: the kvboost worker runs in
# kvboost's venv (experiments/shared/kvboost_worker.py)
OWN_ENV = {"kvboost"}
# core requirements that kvnotes/ does not import but needs at run time: transformers' GGUF reader
# loads through them (the conversion of every packaged model)
LOADED_FOR_US = {"gguf", "accelerate"}
# harness requirements that are not imported by name: pandas' parquet engine
HARNESS_ENGINES = {"pyarrow"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0])


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def third_party_imports(*folders: str) -> dict[str, set[str]]:
    """Top-level module -> files importing it, for absolute imports outside the stdlib and us."""
    out: dict[str, set[str]] = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OURS and top != "__future__":
                        out.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return out


def distributions(modules: dict[str, set[str]]) -> set[str]:
    """The installed distributions that provide these modules (normalised names)."""
    provided = packages_distributions()
    missing = sorted(m for m in modules if m not in provided and m not in OWN_ENV)
    assert not missing, f"imported but not installed here (add them to pyproject.toml): {missing}"
    return {_norm(d) for m in modules if m not in OWN_ENV for d in provided[m]}


def test_the_wheel_requires_exactly_what_the_library_imports():
    core = {_req_name(r) for r in _project()["dependencies"]}
    needed = distributions(third_party_imports("kvnotes"))
    assert needed <= core, f"kvnotes/ imports these, the wheel does not require them: {needed - core}"
    extra = core - needed - LOADED_FOR_US
    assert not extra, f"the wheel requires these, kvnotes/ imports none of them: {sorted(extra)}"


def test_the_harness_extra_holds_what_only_the_harness_imports():
    project = _project()
    core = {_req_name(r) for r in project["dependencies"]}
    harness = {_req_name(r) for r in project["optional-dependencies"]["harness"]}
    needed = distributions(third_party_imports(*HARNESS))
    assert needed <= core | harness, f"the harness imports these, no list has them: {needed - core - harness}"
    assert not harness & core, f"in both the wheel and the harness extra: {harness & core}"
    unused = harness - needed - HARNESS_ENGINES
    assert not unused, f"the harness extra lists these, the harness imports none of them: {sorted(unused)}"
    assert {"hydra-core", "matplotlib", "pyarrow", "httpx", "httpx-sse",
            "prometheus-client"} <= harness


def test_dev_and_notebooks_install_the_harness_and_the_quickstart_does():
    extras = _project()["optional-dependencies"]
    assert "harness" in re.search(r"kvnotes\[(.*)\]", " ".join(extras["dev"])).group(1).split(",")
    assert "kvnotes[harness]" in extras["notebooks"]
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    assert len(commands) == 2
    assert "-e '.[harness]'" in commands[0] and "-e '.[dev]'" in commands[1]


def test_torch_and_transformers_are_ranges_with_the_known_break_excluded():
    deps = {_req_name(r): r for r in _project()["dependencies"]}
    assert "==" not in deps["torch"] and ">=" in deps["torch"]
    assert "==" not in deps["transformers"] and "<5.24" in deps["transformers"]
