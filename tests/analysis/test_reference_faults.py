"""analysis.reference takes a run as the runner wrote it, or says why not in one line (issue 54):
files edited after the run finished (their digests), a link where a file belongs, a run from
before digests, weights checked by header only, a second copy over the first, a commit that is not
a commit id."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from run_folders import seal, write_run
from tiny_runs import ONE_THREAD, hydra_ready, read, selfcheck_cfg  # noqa: F401

import runner.main as runner
from analysis import reference
from kvnotes.measure import digests, provenance
from runner import summarize

COMMIT = "a" * 40


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A completed tiny run, as the runner leaves it, at a clean commit (copied by each test)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(provenance, "git_state", lambda repo=None: {"commit": COMMIT, "branch": "main", "dirty": False})
    try:
        return runner.run(selfcheck_cfg(tmp_path_factory.mktemp("runs"), ONE_THREAD))
    finally:
        mp.undo()


def _copy(run: Path, root: Path) -> Path:
    dest = root / "selfcheck" / "tiny-llama" / run.name
    shutil.copytree(run, dest)
    return dest


def _refused(capsys, run: Path, to: Path, match: str, *flags: str) -> None:
    assert reference.main([str(run), "--to", str(to), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and match in err, err
    assert not to.exists()  # nothing copied


def test_a_finished_run_records_the_digest_of_every_file(finished):
    meta = read(finished / "meta.json")
    assert set(digests.recorded(meta)) == {*digests.DIGESTED, "meta.json"}
    assert digests.changed(finished, meta) == []
    assert reference.check_run(finished)["status"] == "completed"


def _edit_summary(run: Path) -> None:
    (run / "summary.json").write_text(json.dumps({**read(run / "summary.json"), "n_usable": 99}))


def _edit_records(run: Path) -> None:
    frame = pd.read_parquet(run / "records.parquet")
    frame.assign(margin=123.0).to_parquet(run / "records.parquet", index=False)


def _edit_config(run: Path) -> None:
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "seed": 7}))


def _edit_meta(run: Path) -> None:
    (run / "meta.json").write_text(json.dumps({**read(run / "meta.json"), "seed": 7}))


@pytest.mark.parametrize(("edit", "name"), [(_edit_summary, "summary.json"), (_edit_records, "records.parquet"),
                                            (_edit_config, "config.yaml"), (_edit_meta, "meta.json")])
def test_a_run_edited_after_it_finished_is_refused_even_with_force(finished, tmp_path, capsys, edit, name):
    run = _copy(finished, tmp_path / "runs")
    edit(run)
    _refused(capsys, run, tmp_path / "ref", f"{name} changed since the run finished")
    _refused(capsys, run, tmp_path / "ref", f"{name} changed since the run finished", "--force")


def test_resummarize_refreshes_the_digest_of_the_summary_it_rewrites(finished, tmp_path):
    run = _copy(finished, tmp_path / "runs")
    _edit_summary(run)
    summarize.resummarize(run, {"commit": COMMIT, "dirty": False})  # rebuilt from the records
    assert "n_usable" not in read(run / "summary.json") and read(run / "summary.json")["resummarized"]
    meta = read(run / "meta.json")
    assert digests.recorded(meta)["summary.json"] == digests.file_sha256(run / "summary.json")
    assert digests.changed(run, meta) == []
    assert reference.copy_run(run, tmp_path / "ref").is_dir()


def test_a_summary_linked_to_a_file_outside_the_run_is_refused(finished, tmp_path, capsys):
    """The link's target holds the very bytes the run wrote: the link alone is refused."""
    run = _copy(finished, tmp_path / "runs")
    outside = tmp_path / "elsewhere.json"
    shutil.copy(run / "summary.json", outside)
    (run / "summary.json").unlink()
    (run / "summary.json").symlink_to(outside)
    _refused(capsys, run, tmp_path / "ref", "summary.json is a symbolic link", "--force")
    linked = tmp_path / "linked" / "selfcheck" / "tiny-llama" / "2026-01-01_00-00-00"
    linked.parent.mkdir(parents=True)
    linked.symlink_to(finished)
    _refused(capsys, linked, tmp_path / "ref", "is a symbolic link")


def test_a_run_without_digests_needs_force_and_is_marked(tmp_path, capsys):
    run = write_run(tmp_path / "runs", "patching", "llama", "2026-01-01_00-00-00", [{"recovery": 0.1}])
    meta = read(run / "meta.json")
    del meta["digests"]  # finished before runs recorded them
    (run / "meta.json").write_text(json.dumps(meta))
    _refused(capsys, run, tmp_path / "ref", "records no digests of the run's files")
    assert reference.main([str(run), "--to", str(tmp_path / "ref"), "--force"]) == 0
    copied = read(reference.destination(run, tmp_path / "ref") / "meta.json")
    assert copied["reference"]["forced"] and "no digests" in copied["reference"]["reason"]


def _header_checked(tmp_path: Path) -> tuple[Path, Path]:
    """A run whose weights were checked by size and header only, and its weights file."""
    weights = tmp_path / "models" / "llama"
    weights.mkdir(parents=True)
    data = bytes(range(256)) * 64
    (weights / "model.safetensors").write_bytes(data)
    run = write_run(tmp_path / "runs", "patching", "llama", "2026-01-01_00-00-00", [{"recovery": 0.1}])
    meta = read(run / "meta.json")
    meta["model"] = {**meta["model"], "weights_verified": "size+header", "path": str(weights),
                     "weights_files": {"model.safetensors": hashlib.sha256(data).hexdigest()}}
    (run / "meta.json").write_text(json.dumps(meta))
    return seal(run), weights / "model.safetensors"


def test_weights_checked_by_header_only_are_re_hashed_before_the_run_is_promoted(tmp_path, capsys):
    run, weights = _header_checked(tmp_path)
    assert reference.check_run(run)["status"] == "completed"  # re-hashed now: the recorded sha256
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0x01  # one bit inside tensor data: same size, same header
    weights.write_bytes(bytes(data))
    reference._rehash.cache_clear()
    _refused(capsys, run, tmp_path / "ref", "now hashes to a sha256 other than the one recorded")
    assert reference.main([str(run), "--to", str(tmp_path / "ref"), "--force"]) == 0
    copied = read(reference.destination(run, tmp_path / "ref") / "meta.json")
    assert "verify_weights=header" in copied["reference"]["reason"]
    weights.unlink()  # promoted on another machine: nothing to re-hash
    with pytest.raises(ValueError, match="model.safetensors is not here to re-hash now"):
        reference.check_run(run)


def test_a_run_already_in_the_reference_set_is_not_copied_over(tmp_path, capsys):
    run = write_run(tmp_path / "runs", "patching", "llama", "2026-01-01_00-00-00", [{"recovery": 0.1}])
    assert reference.main([str(run), "--to", str(tmp_path / "ref")]) == 0
    dest = reference.destination(run, tmp_path / "ref")
    (dest / "summary.json").write_text("{}")  # whatever is there now stays
    assert reference.main([str(run), "--to", str(tmp_path / "ref")]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds config.yaml" in err and "remove that copy first" in err and "\n" not in err
    assert (dest / "summary.json").read_text() == "{}"


def test_a_commit_that_is_not_a_commit_id_never_reaches_git(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(reference.subprocess, "run", lambda *a, **k: calls.append(a))
    meta = {"status": "completed", "git": {"commit": "--output=/tmp/x", "dirty": False}}
    assert "is not a commit id" in reference.dirty_reason(meta, tmp_path)
    assert reference.in_history("--output=/tmp/x", tmp_path) is False and not calls
