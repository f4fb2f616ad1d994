"""A run is clean only if every attempt was (issue #36): each attempt keeps its commit and dirty
flag, the top level sums them, and analysis.reference refuses a run with a dirty attempt."""

from __future__ import annotations

import json

import pytest
from run_folders import seal
from tiny_runs import ONE_THREAD, hydra_ready, interrupted_run, read, selfcheck_cfg  # noqa: F401

import runner.main as runner
from analysis import reference
from kvnotes.measure import provenance

# --- 4. a dirty attempt makes the run dirty ------------------------------------------------------


def test_a_run_with_a_dirty_attempt_is_dirty_and_refused_by_reference(tmp_path, monkeypatch):
    commit = "a" * 40

    def tree(dirty):
        monkeypatch.setattr(provenance, "git_state",
                            lambda repo=None: {"commit": commit, "branch": "main", "dirty": dirty})

    tree(True)  # the first attempt from an edited tree, interrupted (interrupted_run undoes the patches)
    interrupted_run(tmp_path / "runs", monkeypatch, ONE_THREAD)
    tree(False)  # the tree restored, the rerun resumes
    path = runner.run(selfcheck_cfg(tmp_path / "runs", ONE_THREAD))
    meta = read(path / "meta.json")
    assert meta["status"] == "completed" and len(meta["attempts"]) == 2
    assert [a["dirty"] for a in meta["attempts"]] == [True, False]
    assert [a["git_commit"] for a in meta["attempts"]] == [commit, commit]
    assert meta["git"]["dirty"] is True and meta["dirty"] is True
    with pytest.raises(ValueError, match="attempt 1 of 2 ran from a dirty tree"):
        reference.check_run(path)
    assert reference.check_run(path, force=True)["status"] == "completed"


def test_reference_refuses_a_dirty_attempt_even_when_the_top_level_says_clean(tmp_path, monkeypatch):
    """A run dir written before the top level summed its attempts: the attempts decide."""
    path = interrupted_run(tmp_path / "runs", monkeypatch, ONE_THREAD)
    runner.run(selfcheck_cfg(tmp_path / "runs", ONE_THREAD))
    meta = read(path / "meta.json")
    meta["git"] = {**meta["git"], "commit": "b" * 40, "dirty": False}
    meta["attempts"] = [{**a, "git_commit": "b" * 40, "dirty": d} for a, d in zip(meta["attempts"], [True, False])]
    (path / "meta.json").write_text(json.dumps(meta))
    seal(path)  # as that older runner left it
    with pytest.raises(ValueError, match="attempt 1 of 2 ran from a dirty tree"):
        reference.check_run(path)
