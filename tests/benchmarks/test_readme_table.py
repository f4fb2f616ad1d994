"""benchmarks.readme_table: the README's performance table is the one the committed JSONs give."""

import json

import pytest

from benchmarks import readme_table


def test_the_readme_table_is_regenerated_from_the_committed_runs():
    readme = (readme_table.ROOT / "README.md").read_text()
    assert readme_table.table() in readme  # rerun `python -m benchmarks.readme_table --write`
    assert readme_table.replace(readme, readme_table.table()) == readme


def test_one_row_per_commit_and_machine_with_its_lengths_in_order_and_other_runs_skipped(tmp_path):
    row = {"model": "qwen-1.5b", "dtype": "float32", "reps": 3, "device": "cpu",
           "cpu": {"model": "Intel(R) Xeon(R) Processor", "flags": ["avx512f", "amx_bf16"]}}
    (tmp_path / "a.json").write_text(json.dumps([
        row | {"length": 1000, "inplace_share_of_limit": 0.91, "multiblock_k0_share_of_limit": 0.9,
               "tier_host_speedup": 12.0, "tier_disk_speedup": 11.5},
        row | {"length": 8000, "inplace_share_of_limit": 0.95, "multiblock_k0_share_of_limit": None,
               "tier_host_speedup": 50.0, "tier_disk_speedup": 49.0}]))
    (tmp_path / "b.json").write_text(json.dumps([row | {"length": 1000, "transplant_speedup": 7.0}]))
    assert readme_table.rows(tmp_path) == [
        "| qwen-1.5b float32 | Intel Xeon (AMX) | 1k / 8k | 0.91 / 0.95 | 0.90 / - | 12.0 / 50.0 | 11.5 / 49.0 | 3 | `a.json` |"]
    # another run of the same commit on the same machine joins the row, its lengths in order
    (tmp_path / "c.json").write_text(json.dumps([row | {"length": 4000, "reps": 5, "inplace_share_of_limit": 0.93,
                                                         "multiblock_k0_share_of_limit": 0.92,
                                                         "tier_host_speedup": 30.0, "tier_disk_speedup": 29.0}]))
    assert readme_table.rows(tmp_path) == [
        "| qwen-1.5b float32 | Intel Xeon (AMX) | 1k / 4k / 8k | 0.91 / 0.93 / 0.95 | 0.90 / 0.92 / - | "
        "12.0 / 30.0 / 50.0 | 11.5 / 29.0 / 49.0 | 3 / 5 / 3 | `a.json`, `c.json` |"]
    other = row | {"commit": "abc", "length": 2000, "inplace_share_of_limit": 0.8}
    (tmp_path / "d.json").write_text(json.dumps([other]))
    assert len(readme_table.rows(tmp_path)) == 2  # another commit is another row
    with pytest.raises(ValueError, match="markers"):
        readme_table.replace("no table here", "x")
