"""A non-editable install: the wheel carries the library only, and the harness runs from a checkout.

Builds the wheel, installs it (no dependencies: the venv reads this environment's site
directories, whichever kind of environment runs the suite: a venv, a conda env or the system
interpreter) into a fresh venv, and checks what a new user meets: `import kvnotes` from site-packages, no top-level
`experiments` / `analysis` / `probes` installed, and `kvnotes run` of one tiny job from the
repository root (the case that failed with "Primary config directory not found").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _outer_site_dirs() -> list[str]:
    """This environment's site directories (a venv, a conda env or the system interpreter), not
    the checkout: the inner venv reads its dependencies from them without seeing the editable
    install of kvnotes, whose finder is started by a `.pth` file that a path line never runs."""
    out = []
    for p in sys.path:
        path = Path(p or ".").resolve()
        if path.is_dir() and path != ROOT and path.name in ("site-packages", "dist-packages"):
            out.append(str(path))
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp.glob("kvnotes-*.whl")
    env_dir = tmp / "venv"
    # Not system_site_packages: inside a venv that would expose the base interpreter's packages,
    # not this environment's (the suite failed with "No module named 'torch'" in a fresh venv).
    venv.create(env_dir, system_site_packages=False, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # the wheel into the venv's own site-packages (first on its path), then this environment's
    # site directories after it, for torch, transformers and the rest
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site,
                    str(wheel)], check=True, capture_output=True)
    (Path(site) / "_outer_env.pth").write_text("\n".join(_outer_site_dirs()) + "\n")
    return wheel, env_dir, Path(site)


def test_the_inner_venv_sees_this_environments_packages(installed):
    _, env_dir, _ = installed
    out = subprocess.run([str(env_dir / "bin" / "python"), "-I", "-c",
                          "import torch, transformers; print(torch.__file__)"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-500:]
    assert not out.stdout.startswith(str(env_dir))


def test_the_wheel_carries_the_library_only(installed):
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvnotes"}
    assert "kvnotes/tasks/templates/gated.yaml" in names and "kvnotes/py.typed" in names


def test_installed_library_imports_from_site_packages_and_no_harness(installed, tmp_path):
    _, env_dir, site = installed
    py = str(env_dir / "bin" / "python")
    out = subprocess.run(
        [py, "-c", "import importlib.util as u, kvnotes; print(kvnotes.__file__); "
                   "print([m for m in ('experiments', 'analysis', 'probes') if u.find_spec(m)])"],
        cwd=tmp_path, check=True, capture_output=True, text=True).stdout.split("\n")
    assert out[0].startswith(str(site)) and out[1] == "[]"


def test_kvnotes_command_runs_a_tiny_job_from_the_checkout(installed, tmp_path):
    _, env_dir, site = installed
    exe = env_dir / "bin" / "python"
    cli = [str(exe), "-I", "-c", "import sys; from kvnotes.cli import main; sys.exit(main())"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outside = subprocess.run(cli + ["run", "+experiment=selfcheck"], cwd=tmp_path, env=env,
                             capture_output=True, text=True)
    assert outside.returncode == 2
    assert outside.stderr.strip().startswith("error: `kvnotes run` runs the repository's harness")
    args = ["run", "+experiment=selfcheck", "model.name=tiny-llama", "model.tiny_family=llama",
            "experiment.n_blocks=1", "experiment.seams=[0]", "progress=false",
            f"results_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'hydra'}"]
    done = subprocess.run(cli + args, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (meta,) = (tmp_path / "runs").glob("selfcheck/tiny-llama/*/meta.json")
    assert json.loads(meta.read_text())["status"] == "completed"
