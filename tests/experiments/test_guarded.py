"""Child processes that cannot outlive what started them (issue #36): the serving stack's whole
process group dies with its watchdog, and the kvboost worker runs under the same guard.

Stand-ins only: a python child that starts a grandchild and sleeps plays vLLM's api_server
with its EngineCore, and a fake interpreter plays kvboost's venv. Nothing here starts vLLM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving import server
from serving.watchdog import group_members

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, PR_SET_PDEATHSIG: Linux")
ROOT = Path(__file__).resolve().parents[2]
SERVER = ("import subprocess, sys, time; "
          "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
          "print('child', p.pid, flush=True); time.sleep(300)")


def _wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _pids(log: Path) -> list[int]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [int(x.split()[1]) for x in lines if x.startswith(("child ", "worker "))]


def _kill(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_group_dies_when_the_watchdog_alone_is_sigkilled(tmp_path):
    """vLLM's api_server died with its watchdog (PR_SET_PDEATHSIG), its EngineCore and Worker
    stayed: the guard now kills the whole group whichever of its processes is killed."""
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = server.spawn_guarded([sys.executable, "-c", SERVER], stdout=out)
    try:
        assert _wait(lambda: _pids(log)), "the stand-in server never started its child"
        (grandchild,) = _pids(log)
        assert grandchild in group_members(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the watchdog alone
        proc.wait(10)
        assert _wait(lambda: not group_members(proc.pid), 10), "the group outlived its watchdog"
        assert not _alive(grandchild)
    finally:
        _kill(group_members(proc.pid))


FAKE_PYTHON = """#!/bin/sh
exec {python} -c "
import os, subprocess, sys, time
p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])
with open('{log}', 'a') as f:
    f.write(f'worker {{os.getpid()}}\\nchild {{p.pid}}\\n')
time.sleep(300)
" "$@"
"""
EXPERIMENT = """
import sys
sys.path.insert(0, {root!r})
from types import SimpleNamespace
from experiments.shared import kvboost as _kvboost
_kvboost.run_worker({python!r}, SimpleNamespace(source_path="unused"), {{}}, [], 64, 300)
"""


def test_the_kvboost_worker_dies_with_the_experiment(tmp_path):
    log, python = tmp_path / "worker.log", tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable, log=log))
    python.chmod(0o755)
    exp = subprocess.Popen([sys.executable, "-c", EXPERIMENT.format(root=str(ROOT), python=str(python))])
    try:
        assert _wait(lambda: len(_pids(log)) == 2, 60), "the fake worker never started"
        worker, child = _pids(log)
        exp.send_signal(signal.SIGKILL)  # no finally runs in the experiment
        exp.wait(10)
        assert _wait(lambda: not _alive(worker) and not _alive(child), 10), "the worker outlived the experiment"
    finally:
        if exp.poll() is None:
            exp.kill()
        _kill(_pids(log))


def test_run_guarded_returns_the_output_and_kills_the_group_on_timeout(tmp_path):
    from serving.guard import run_guarded

    done = run_guarded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                        "raise SystemExit(3)"], timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    log = tmp_path / "slow.log"
    code = SERVER.replace("print('child', p.pid, flush=True)", f"open({str(log)!r}, 'w').write(f'child {{p.pid}}')")
    with pytest.raises(subprocess.TimeoutExpired):
        run_guarded([sys.executable, "-c", code], timeout=5)
    assert _wait(lambda: not any(_alive(p) for p in _pids(log)), 10)


def test_the_kvboost_worker_imports_the_package_not_the_driver_beside_it(tmp_path):
    """The worker's folder holds experiments/shared/kvboost.py (the driver); Python puts that folder
    first on the path, so without care `import kvboost` in the worker finds the driver."""
    pkg = tmp_path / "site" / "kvboost"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit(17)  # the real package would be imported here\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run([sys.executable, str(ROOT / "experiments/shared/kvboost_worker.py"),
                           str(tmp_path / "job.json"), str(tmp_path / "out")], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 17, proc.stderr.decode()[-800:]
