"""runner.merge refuses what is not the shards of one run, in one line, before writing anything."""

import json

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
