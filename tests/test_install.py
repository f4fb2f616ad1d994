"""A non-editable install: the wheel carries the library only, and the harness runs from a checkout.

Builds the wheel, installs it (no dependencies: the venv sees this environment's packages) into
a fresh venv, and checks what a new user meets: `import kvnotes` from site-packages, no top-level
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

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp.glob("kvnotes-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    py = env_dir / "bin" / "python"
    # pip of this environment, installing into the venv's own site-packages
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site,
                    str(wheel)], check=True, capture_output=True)
    return wheel, env_dir, Path(site)


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
