"""runner.merge refuses what is not the shards of one run, in one line, before writing anything."""

import json

import pandas as pd
import pytest
from run_folders import seal

from analysis import reference
from kvnotes.measure import digests
from runner import merge


def _shard(root, stamp, commit="a" * 40, status="completed", item_slice=(0, 1)):
    d = root / "blend" / "tiny" / stamp
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"experiment:\n  item_slice: [{item_slice[0]}, {item_slice[1]}]\n  n_items: 4\n")
    (d / "meta.json").write_text(json.dumps({"status": status, "git": {"commit": commit, "dirty": False}}))
    (d / "records.parquet").write_bytes(b"")
    (d / "summary.json").write_text("{}")
    return d


def _refused(capsys, shards, match):
    parent = shards[0].parent
    before = sorted(parent.iterdir())
    assert merge.main([str(s) for s in shards]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and match in err, err
    assert sorted(parent.iterdir()) == before  # nothing written


def test_merge_refuses_what_is_not_one_run_in_one_line(tmp_path, capsys):
    a = _shard(tmp_path, "2026-01-01_00-00-00")
    _refused(capsys, [a], "at least two")
    _refused(capsys, [a, _shard(tmp_path, "2026-01-01_00-00-01", status="running")], "only completed")
    _refused(capsys, [a, _shard(tmp_path, "2026-01-01_00-00-02", commit="b" * 40, item_slice=(1, 2))], "one commit")
    _refused(capsys, [a, _shard(tmp_path, "2026-01-01_00-00-03")], "overlap")
    incomplete = tmp_path / "blend" / "tiny" / "2026-01-01_00-00-04"
    incomplete.mkdir()
    _refused(capsys, [a, incomplete], "missing")


# --- issue 54: what a merge claims is what its shards hold ----------------------------------------


def _records(items, workload="skills"):
    """A blend shard's records: one unit per item, and the verify unit every shard writes."""
    rows = [{"unit": f"{workload}:{i}", "kind": "blend", "workload": workload, "item_id": i, "cosine": 0.5}
            for i in items]
    return pd.DataFrame([*rows, {"unit": "verify", "kind": "verify", "workload": None, "item_id": None,
                                 "cosine": 1.0}])


def _full_shard(root, stamp, item_slice, items, dirty=False, sealed=True):
    d = _shard(root, stamp, item_slice=item_slice)
    meta = {"status": "completed", "git": {"commit": "a" * 40, "dirty": dirty}, "dirty": dirty,
            "start_time": stamp, "end_time": stamp, "attempts": [{"git_commit": "a" * 40, "dirty": dirty}]}
    (d / "meta.json").write_text(json.dumps(meta))
    _records(items).to_parquet(d / "records.parquet", index=False)
    (d / "summary.json").write_text(json.dumps({"finished": stamp}))
    return seal(d) if sealed else d


@pytest.fixture
def no_job(monkeypatch):
    """The merge's summary without a registered job: these shards' config is a bare blend section."""
    monkeypatch.setattr(merge, "discover", lambda: None)
    monkeypatch.setattr(merge, "validate", lambda cfg, check_inputs=True: None)
    monkeypatch.setattr(merge, "build_summary", lambda job, records: {"n_records": len(records)})


def test_merge_refuses_slices_that_leave_an_item_out(tmp_path, capsys, no_job):
    """[0,2] and [3,4] of n_items=4 merged into a run that claimed all four items with three."""
    a = _full_shard(tmp_path, "2026-01-01_00-00-00", (0, 2), ["i0", "i1"])
    b = _full_shard(tmp_path, "2026-01-01_00-00-01", (3, 4), ["i3"])
    _refused(capsys, [a, b], "leave items [2, 3) of n_items=4 in no shard")
    c = _full_shard(tmp_path, "2026-01-01_00-00-02", (2, 3), ["i2"])
    _refused(capsys, [b, c], "leave items [0, 2) of n_items=4 in no shard")  # the head missing
    _refused(capsys, [a, c], "leave items [3, 4) of n_items=4 in no shard")  # the tail missing


def test_merge_refuses_a_shard_relabelled_to_repeat_another_shards_items(tmp_path, capsys, no_job):
    """The second shard's slice says [2,4), its records hold [0,2)'s items: every unit was 'shared',
    kept once, and the merged run claimed n_items 4 with 2 items."""
    a = _full_shard(tmp_path, "2026-01-01_00-00-00", (0, 2), ["i0", "i1"])
    b = _full_shard(tmp_path, "2026-01-01_00-00-01", (2, 4), ["i0", "i1"])
    _refused(capsys, [a, b], "items in more than one shard: ['skills:i0', 'skills:i1']")


def test_a_merge_with_one_dirty_shard_is_dirty_at_the_top_level(tmp_path, no_job):
    a = _full_shard(tmp_path, "2026-01-01_00-00-00", (0, 2), ["i0", "i1"])
    b = _full_shard(tmp_path, "2026-01-01_00-00-01", (2, 4), ["i2", "i3"], dirty=True)
    meta = json.loads((merge.merge_runs([a, b]) / "meta.json").read_text())
    assert meta["dirty"] is True and meta["git"]["dirty"] is True
    assert "dirty tree" in reference.dirty_reason(meta)
    clean = _full_shard(tmp_path, "2026-01-01_00-00-02", (2, 4), ["i2", "i3"])
    meta = json.loads((merge.merge_runs([a, clean]) / "meta.json").read_text())
    assert meta["dirty"] is False and meta["git"]["dirty"] is False


def test_a_merged_run_records_digests_only_when_every_shard_did(tmp_path, no_job):
    a = _full_shard(tmp_path, "2026-01-01_00-00-00", (0, 2), ["i0", "i1"])
    b = _full_shard(tmp_path, "2026-01-01_00-00-01", (2, 4), ["i2", "i3"])
    merged = merge.merge_runs([a, b])
    meta = json.loads((merged / "meta.json").read_text())
    assert digests.recorded(meta) is not None and digests.changed(merged, meta) == []
    old = _full_shard(tmp_path, "2026-01-01_00-00-02", (2, 4), ["i2", "i3"], sealed=False)
    assert "digests" not in json.loads((merge.merge_runs([a, old]) / "meta.json").read_text())


def test_merge_refuses_a_shard_edited_since_it_finished(tmp_path, capsys, no_job):
    a = _full_shard(tmp_path, "2026-01-01_00-00-00", (0, 2), ["i0", "i1"])
    b = _full_shard(tmp_path, "2026-01-01_00-00-01", (2, 4), ["i2", "i3"])
    _records(["i2", "i3"]).assign(cosine=123.0).to_parquet(b / "records.parquet", index=False)
    _refused(capsys, [a, b], "records.parquet changed since the shard finished")


def test_merge_of_a_truncated_records_file_is_one_line(tmp_path, capsys, no_job):
    a = _full_shard(tmp_path, "2026-01-01_00-00-00", (0, 2), ["i0", "i1"])
    b = _full_shard(tmp_path, "2026-01-01_00-00-01", (2, 4), ["i2", "i3"], sealed=False)
    data = (b / "records.parquet").read_bytes()
    (b / "records.parquet").write_bytes(data[: len(data) // 2])
    _refused(capsys, [a, b], "records.parquet cannot be read")
