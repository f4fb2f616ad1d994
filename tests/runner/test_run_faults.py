"""Faults that used to cost results (issue #36): two openers at once, and damaged parts. Each
ends with one run dir, computed in full."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf
from tiny_runs import ONE_THREAD, hydra_ready, interrupted_run, read, selfcheck_cfg  # noqa: F401

import kvnotes.compose.splice
import runner.main as runner
from runner import rundir as output
from runner.rundir import RecordWriter, RunDir, RunDirError

ROOT = Path(__file__).resolve().parents[2]


def counted(monkeypatch) -> list[int]:
    """Count the selfcheck's blocks computed from now on."""
    real, calls = kvnotes.compose.splice.self_check, []

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kvnotes.compose.splice, "self_check", counting)
    return calls


# --- 1. one lock around find-unfinished-or-create -------------------------------------------------


def test_two_openers_at_the_same_moment_make_one_run_dir(tmp_path, monkeypatch):
    real = output.find_unfinished

    def slow_search(parent, chash):  # both have searched before either creates, unless locked
        found = real(parent, chash)
        time.sleep(0.3)
        return found

    monkeypatch.setattr(output, "find_unfinished", slow_search)
    start, got = threading.Barrier(2), []

    def opener():
        start.wait()
        try:
            got.append(RunDir.open(tmp_path, "job", "model", OmegaConf.create({"x": 1}), "h1", True,
                                   {"git": {"commit": "c" * 40, "dirty": False}}))
        except RunDirError as e:
            got.append(e)

    threads = [threading.Thread(target=opener) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    runs = [g for g in got if isinstance(g, RunDir)]
    refused = [g for g in got if isinstance(g, RunDirError)]
    try:
        assert len(runs) == 1 and len(refused) == 1, got
        assert f"{runs[0].path} is in use by pid {os.getpid()}" in str(refused[0])
        assert [p for p in (tmp_path / "job" / "model").iterdir() if p.is_dir()] == [runs[0].path]
    finally:
        for r in runs:
            r.close()


def test_a_running_run_whose_holder_died_is_resumed(tmp_path, monkeypatch):
    path = interrupted_run(tmp_path, monkeypatch, ONE_THREAD)
    meta = read(path / "meta.json") | {"status": "running"}  # killed with SIGKILL: no status written
    (path / "meta.json").write_text(json.dumps(meta))
    assert runner.run(selfcheck_cfg(tmp_path, ONE_THREAD)) == path
    assert read(path / "meta.json")["status"] == "completed"


# --- 2. a part is done only when it checks out ------------------------------------------------


def test_a_truncated_part_is_computed_again_with_one_warning(tmp_path, monkeypatch, caplog):
    path = interrupted_run(tmp_path, monkeypatch, ONE_THREAD)
    part = path / "parts" / "block-000.parquet"
    part.write_bytes(part.read_bytes()[:-100])
    calls = counted(monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert runner.run(selfcheck_cfg(tmp_path, ONE_THREAD)) == path
    assert len(calls) == 3 and read(path / "meta.json")["status"] == "completed"
    assert sorted(pd.read_parquet(path / "records.parquet")["block"].unique()) == [0, 1, 2]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "block-000.parquet" in warning and "computing it again" in warning and "\n" not in warning


def test_a_bit_flip_in_a_part_is_computed_again(tmp_path, monkeypatch):
    clean = runner.run(selfcheck_cfg(tmp_path / "clean", ONE_THREAD))
    path = interrupted_run(tmp_path / "flip", monkeypatch, ONE_THREAD)
    part = path / "parts" / "block-000.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x04  # one bit inside the column data
    part.write_bytes(bytes(data))
    calls = counted(monkeypatch)
    runner.run(selfcheck_cfg(tmp_path / "flip", ONE_THREAD))
    assert len(calls) == 3
    pd.testing.assert_frame_equal(pd.read_parquet(path / "records.parquet"),
                                  pd.read_parquet(clean / "records.parquet"))


def test_record_writer_checks_every_part_it_reads(tmp_path, caplog):
    w = RecordWriter(tmp_path)
    w.write("a", [{"x": 1.0}])
    w.write("b", [{"x": 2.0}])
    assert (w.parts / "a.parquet.sha256").is_file()
    (w.parts / "b.parquet.sha256").unlink()  # written by a kvnotes that kept no checksum: read back
    w = RecordWriter(tmp_path)  # a rerun
    assert w.done("a") and w.done("b") and (w.parts / "b.parquet.sha256").is_file()
    w = RecordWriter(tmp_path)
    (w.parts / "a.parquet").write_bytes(b"PAR1 not a parquet file PAR1")
    with caplog.at_level(logging.WARNING):
        assert not w.done("a") and not w.done("a")  # one warning, the damaged part is gone
    assert len([r for r in caplog.records if "a.parquet" in r.getMessage()]) == 1
    assert list(w.read()["x"]) == [2.0]


# --- issue 54: what a resume finds, and a unit named like a hidden file ----------------------------


def test_an_attempt_killed_with_sigkill_is_marked_died_on_the_resume(tmp_path, monkeypatch):
    path = interrupted_run(tmp_path, monkeypatch, ONE_THREAD)
    meta = read(path / "meta.json")
    meta["status"] = meta["attempts"][-1]["status"] = "running"  # what SIGKILL leaves behind
    (path / "meta.json").write_text(json.dumps(meta))
    assert runner.run(selfcheck_cfg(tmp_path, ONE_THREAD)) == path
    attempts = read(path / "meta.json")["attempts"]
    assert [a["status"] for a in attempts] == ["died", "completed"]
    assert "ended without recording a status" in attempts[0]["note"]


def test_a_unit_key_starting_with_a_dot_is_read_back(tmp_path):
    """parts/.hidden-<hash>.parquet was marked done and skipped as a temporary file when read."""
    writer = RecordWriter(tmp_path)
    writer.write(".hidden", [{"x": 1}])
    writer.write("..", [{"x": 2}])
    assert writer.done(".hidden") and writer.done("..")
    assert sorted(writer.finalize()["unit"]) == ["..", ".hidden"]
    assert not any(p.name.startswith(".") for p in (tmp_path / "parts").iterdir())


BAD_CONFIG = "defaults:\n  - selfcheck\n  - _self_\nseed: !!python/object/apply:os.getpid []\n"


def test_a_hydra_config_with_a_python_tag_is_one_error_line(tmp_path):
    (tmp_path / "configs" / "experiment").mkdir(parents=True)
    (tmp_path / "configs" / "experiment" / "tagged.yaml").write_text(BAD_CONFIG)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "+experiment=tagged",
                           f"hydra.searchpath=[file://{tmp_path / 'configs'}]", f"results_dir={tmp_path}",
                           "model.name=tiny-llama", "model.tiny_family=llama"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: could not determine a constructor for the tag") and "tagged.yaml" in line
    assert "no tags" in line and not (tmp_path / "selfcheck").exists()
