"""benchmarks.engine: its arguments, its limit outside kvnotes' call path, its ratios and keys."""

import pytest
import torch
from tolerances import ATOL_FP32

from benchmarks import engine
from kvnotes import run
from kvnotes.models.tiny import tiny_model


def test_arguments_are_checked_before_any_work():
    a = engine.parse_args(["--lengths", "1000,2000", "--reps", "2", "--only", "edit"])
    assert a.lengths == [1000, 2000] and a.only == ["edit"] and a.clock == "wall"
    for bad in (["--lengths", "10"], ["--lengths", "1k"], ["--reps", "0"], ["--only", "ttfb"]):
        with pytest.raises(SystemExit):
            engine.parse_args(bad)


def test_the_bare_limit_matches_the_engine_and_flops_scale():
    m = tiny_model("qwen2")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ctx = run.prefill(m, ids[:, :33]).cache
    bare = engine.bare_forward(m, engine.bare_cache(ctx), ids[:, 33:])
    assert (bare - run.extend(m, ctx, ids[:, 33:]).logits[0, -1]).abs().max().item() <= ATOL_FP32
    assert ctx.seq_len == 33  # the bare cache is a copy: the context is untouched
    full, limit = engine.forward_flops(m, 40, 0), engine.forward_flops(m, 7, 33)
    assert full > limit > 0 and engine.forward_flops(m, 7, 330) > limit


def test_summary_has_the_issue_keys_as_ratios_of_medians():
    def timed(name, times):
        return engine.Timed(name, lambda: None, times=list(times))

    paths = [timed("prefill", [10, 12, 11]), timed("extend1", [0.1, 0.2, 0.15]),
             timed("full_downstream", [10, 10, 10]), timed("erratum", [1, 1, 1]),
             timed("map", [15, 15, 15])]
    for tag in ("one", "multi"):
        paths += [timed(f"{tag}_full", [10] * 3), timed(f"{tag}_transplant", [1] * 3),
                  timed(f"{tag}_limit", [0.8] * 3)]
    row = engine.summarize(2000, paths, {"erratum_floor": 0.03})
    assert set(engine.KEYS) <= set(row) and row["map_ratio"] == pytest.approx(15 / 11)
    assert row["extend1_ratio"] == pytest.approx(0.15 / 11)
    assert row["transplant_speedup"] == pytest.approx(10) and row["limit_speedup"] == pytest.approx(12.5)
    assert row["transplant_share_of_limit"] == pytest.approx(0.8)
    assert row["multiblock_share_of_limit"] == pytest.approx(0.8)
    assert "L" in engine.table([row]) and "0.80" in engine.table([row])


def test_rounds_interleave_after_warmup():
    order = []
    paths = [engine.Timed(n, lambda n=n: order.append(n)) for n in "abc"]
    engine.run_rounds(paths, reps=2, warmup=1, device=torch.device("cpu"))
    assert order == list("abc") + list("bca") + list("cab")
    assert all(len(p.times) == 2 for p in paths)


def test_profile_writes_the_operator_table_of_the_profiled_paths(tmp_path):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    paths = [engine.Timed("erratum", lambda: a @ b), engine.Timed("prefill", lambda: a + b),
             engine.Timed("full_downstream", lambda: torch.softmax(a @ b, -1))]
    tops = engine.profile_paths(paths, 2000, tmp_path / "prof", top=3)
    assert set(tops) == {"erratum", "full_downstream"}  # prefill is not profiled
    assert any("mm" in e["op"] for e in tops["erratum"])
    assert any("softmax" in e["op"] for e in tops["full_downstream"])
    assert all(0 <= e["self_cpu_share"] <= 1 for t in tops.values() for e in t) and len(tops["erratum"]) <= 3
    assert sorted(f.name for f in (tmp_path / "prof").iterdir()) == ["L2000_erratum.txt", "L2000_full_downstream.txt"]
    assert "Self CPU" in (tmp_path / "prof" / "L2000_erratum.txt").read_text()
