"""SIGTERM and a full disk (issue #36): the run ends as `interrupted` or `failed` with one line,
and leaves no temporary file."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from tiny_runs import (  # noqa: F401
    ONE_THREAD,
    ROOT,
    SMALL,
    TINY,
    hydra_ready,
    interrupted_run,
    read,
    selfcheck_cfg,
)

import kvnotes.compose.splice
import runner.main as runner
from runner import rundir as output
from runner.rundir import RunDirError

# --- 5. SIGTERM ends as interrupted ---------------------------------------------------------------


class ReachedTheTest(Exception):
    """The test's own SIGTERM handler ran: the runner installed none."""


def test_sigterm_ends_the_run_as_interrupted_and_restores_the_handler(tmp_path, monkeypatch):
    def test_handler(signum, frame):
        raise ReachedTheTest

    previous = signal.signal(signal.SIGTERM, test_handler)
    real, calls = kvnotes.compose.splice.self_check, []

    def killed(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(kvnotes.compose.splice, "self_check", killed)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run(selfcheck_cfg(tmp_path, ONE_THREAD))
        assert signal.getsignal(signal.SIGTERM) is test_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    (path,) = (tmp_path / "selfcheck" / "tiny-llama").iterdir()
    meta = read(path / "meta.json")
    assert meta["status"] == "interrupted" and meta["attempts"][-1]["status"] == "interrupted"


SIGTERM_AT_BLOCK_2 = """
import os, signal, sys
import kvnotes.compose.splice as c
real, calls = c.self_check, []
def killed(*a, **k):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return real(*a, **k)
c.self_check = killed
from runner.main import cli
sys.argv = ["experiments/run.py", *sys.argv[1:]]
cli()
"""


def test_cli_sigterm_is_one_line_and_exit_143(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-c", SIGTERM_AT_BLOCK_2, "+experiment=selfcheck",
                           f"results_dir={tmp_path}", *TINY, *SMALL, ONE_THREAD], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "interrupted (SIGTERM): finished units are on disk; rerun the same command to resume")
    (path,) = (tmp_path / "selfcheck" / "tiny-llama").iterdir()
    assert read(path / "meta.json")["status"] == "interrupted"


# --- 6. a full disk -----------------------------------------------------------------------------


def test_a_full_disk_fails_the_run_in_one_line_and_leaves_no_tmp(tmp_path, monkeypatch):
    path = interrupted_run(tmp_path, monkeypatch, ONE_THREAD)
    real_parquet, real_json = pd.DataFrame.to_parquet, output.write_json
    full = []

    def to_parquet(self, where, *args, **kwargs):
        if isinstance(where, str | os.PathLike):
            Path(where).write_bytes(b"")  # what a write leaves when the disk fills
        full.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    def write_json(where, obj):  # nothing new can be created on a full disk
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_json(where, obj)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", to_parquet)
    monkeypatch.setattr(output, "write_json", write_json)
    with pytest.raises(RunDirError) as e:
        runner.run(selfcheck_cfg(tmp_path, ONE_THREAD))
    monkeypatch.setattr(pd.DataFrame, "to_parquet", real_parquet)
    assert "\n" not in str(e.value) and e.value.__cause__ is None and e.value.__suppress_context__
    assert str(e.value).startswith(f"{path}: No space left on device")
    assert "rerun the same command to resume" in str(e.value)
    meta = read(path / "meta.json")
    assert meta["status"] == "failed" and "No space left on device" in meta["error"]
    assert not [p for p in path.rglob("*") if p.name.endswith(".tmp")]
