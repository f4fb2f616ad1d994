"""A run dir's own files (issue #36): never written through a planted link, and a read-only disk
named as such."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pandas as pd
import pytest
from tiny_runs import ONE_THREAD, hydra_ready, interrupted_run, read, selfcheck_cfg  # noqa: F401

import runner.main as runner
from runner.config import results_problem
from runner.rundir import RecordWriter, RunDirError

# --- 10. links planted in an unfinished run dir -------------------------------------------------


@pytest.mark.parametrize("name", ["command.txt", "run.log", "overrides.yaml", "config.yaml"])
def test_a_link_planted_for_a_run_file_is_refused(tmp_path, monkeypatch, name):
    path = interrupted_run(tmp_path / "runs", monkeypatch, ONE_THREAD)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    (path / name).unlink()
    (path / name).symlink_to(outside)
    with pytest.raises(RunDirError, match=f"{path / name} is a symbolic link") as e:
        runner.run(selfcheck_cfg(tmp_path / "runs", ONE_THREAD))
    assert "\n" not in str(e.value)
    assert outside.read_text() == "not the run's\n"


def test_parts_linked_elsewhere_are_refused_and_the_target_kept(tmp_path, monkeypatch):
    path = interrupted_run(tmp_path / "runs", monkeypatch, ONE_THREAD)
    elsewhere = tmp_path / "elsewhere"
    (path / "parts").rename(elsewhere)
    pd.DataFrame({"x": [1]}).to_parquet(elsewhere / "precious.parquet")
    (path / "parts").symlink_to(elsewhere)
    with pytest.raises(RunDirError, match=r"parts is a symbolic link"):
        runner.run(selfcheck_cfg(tmp_path / "runs", ONE_THREAD))
    assert {p.name for p in elsewhere.iterdir()} >= {"block-000.parquet", "precious.parquet"}


def test_a_linked_part_is_never_merged(tmp_path, monkeypatch, caplog):
    path = interrupted_run(tmp_path / "runs", monkeypatch, ONE_THREAD)
    foreign = tmp_path / "foreign.parquet"
    pd.DataFrame({"unit": ["block-001"], "foreign": [1]}).to_parquet(foreign)
    (path / "parts" / "block-001.parquet").symlink_to(foreign)
    with caplog.at_level(logging.WARNING):
        assert runner.run(selfcheck_cfg(tmp_path / "runs", ONE_THREAD)) == path
    records = pd.read_parquet(path / "records.parquet")
    assert "foreign" not in records and sorted(records["block"].unique()) == [0, 1, 2]
    assert foreign.is_file() and "block-001.parquet is a symbolic link" in caplog.text


def test_cleanup_never_follows_a_link(tmp_path):
    w = RecordWriter(tmp_path / "run")
    w.write("a", [{"x": 1}])
    w.finalize()
    target = tmp_path / "target"
    target.mkdir()
    pd.DataFrame({"x": [1]}).to_parquet(target / "keep.parquet")
    (w.parts / "link.parquet").symlink_to(target / "keep.parquet")
    w.cleanup()
    assert (target / "keep.parquet").is_file()
    w2 = RecordWriter(tmp_path / "run2")
    w2.parts.rmdir()
    w2.parts.symlink_to(target)
    w2.cleanup()
    assert (target / "keep.parquet").is_file()


# --- 12. a read-only file system -----------------------------------------------------------------


def test_a_read_only_results_dir_is_named_as_such(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=os.ST_RDONLY))
    assert results_problem(str(tmp_path / "runs")) == (
        f"results_dir={str(tmp_path / 'runs')!r}: {tmp_path} is on a read-only file system")
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=0))
    assert "no permission to write in" in results_problem(str(tmp_path / "runs"))
