"""benchmarks.engine: its arguments, its limit outside kvnotes' call path, its ratios and keys."""

import json

import pytest
import torch
from tolerances import ATOL_FP32

from benchmarks import engine
from benchmarks import engine_paths as workloads
from kvnotes.engine import run
from kvnotes.measure import provenance
from kvnotes.models.tiny import tiny_model


def test_arguments_are_checked_before_any_work():
    a = engine.parse_args(["--lengths", "1000,2000", "--reps", "2", "--only", "edit"])
    assert a.lengths == [1000, 2000] and a.only == ["edit"] and a.clock == "wall"
    for bad in (["--lengths", "10"], ["--lengths", "1k"], ["--reps", "0"], ["--only", "ttfb"]):
        with pytest.raises(SystemExit):
            engine.parse_args(bad)


def test_bad_model_dtype_or_length_is_one_line_before_any_weights_load(capsys, monkeypatch):
    from kvnotes.models import budget

    def no_load(*a, **k):
        raise AssertionError("weights loaded")

    monkeypatch.setattr("kvnotes.models.load_model", no_load)
    shape = budget.ModelShape.from_config(
        {"max_position_embeddings": 8192, "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8},
        "config.json")
    monkeypatch.setattr(budget, "model_shape", lambda *a: shape)
    for argv, said in ((["--model", "nosuch"], "--model: unknown model 'nosuch'"),
                       (["--model", "llama", "--dtype", "fp8"], "--dtype 'fp8': valid: auto, float32"),
                       (["--model", "llama", "--lengths", "1000,8100"],
                        "--lengths=8100 plus 128 tokens around it exceeds the 8192 positions")):
        assert engine.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {said}") and err.count("\n") == 1


def test_the_bare_limit_matches_the_engine_and_flops_scale():
    m = tiny_model("qwen2")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ctx = run.prefill(m, ids[:, :33]).cache
    bare = workloads.bare_forward(m, workloads.bare_cache(ctx), ids[:, 33:])
    assert (bare - run.extend(m, ctx, ids[:, 33:]).logits[0, -1]).abs().max().item() <= ATOL_FP32
    assert ctx.seq_len == 33  # the bare cache is a copy: the context is untouched
    full, limit = workloads.forward_flops(m, 40, 0), workloads.forward_flops(m, 7, 33)
    assert full > limit > 0 and workloads.forward_flops(m, 7, 330) > limit


def timed(name, times):
    return workloads.Timed(name, lambda: None, times=list(times))


def test_summary_has_the_issue_keys_as_ratios_of_medians():
    paths = [timed("prefill", [10, 12, 11]), timed("extend1", [0.1, 0.2, 0.15]),
             timed("extend1_bare", [0.2, 0.2, 0.2]), timed("extend1_gemms", [0.05, 0.05, 0.05]),
             timed("extend1_copy", [0.022, 0.022, 0.022]),
             timed("full_downstream", [10, 10, 10]), timed("erratum", [1, 1, 1]),
             timed("erratum_gemms", [0.5, 0.6, 0.55]), timed("map", [15, 15, 15])]
    for tag in ("one", "multi"):
        paths += [timed(f"{tag}_full", [10] * 3), timed(f"{tag}_transplant", [1] * 3),
                  timed(f"{tag}_limit", [0.8] * 3)]
    row = engine.summarize(2000, paths, {"erratum_floor": 0.03})
    assert set(engine.KEYS) <= set(row) and row["map_ratio"] == pytest.approx(15 / 11)
    assert row["extend1_ratio"] == pytest.approx(0.15 / 11)
    assert row["extend1_bare_ratio"] == pytest.approx(0.2 / 11)
    assert row["extend1_gemm_floor"] == pytest.approx(0.05 / 11)
    assert row["extend1_over_gemm_floor"] == pytest.approx(3)
    assert row["extend1_copy_ratio"] == pytest.approx(0.002)
    assert row["erratum_gemm_floor"] == pytest.approx(0.55 / 11)
    assert row["erratum_over_gemm_floor"] == pytest.approx(1 / 0.55)
    assert row["transplant_speedup"] == pytest.approx(10) and row["limit_speedup"] == pytest.approx(12.5)
    assert row["transplant_share_of_limit"] == pytest.approx(0.8)
    assert row["multiblock_share_of_limit"] == pytest.approx(0.8)
    assert "L" in engine.table([row]) and "0.80" in engine.table([row])
    assert row["limit_path"] == "bare" and row["limit_bare_speedup"] == pytest.approx(12.5)


def test_the_limit_is_the_faster_question_only_forward_of_the_two():
    """transformers' own forward can be slower than kvnotes' (repeat_kv at long contexts): then
    the engine's forward is the floor, and the shares are against it."""
    paths = [timed("prefill", [10] * 3)]
    for tag, engine_s in (("one", 0.5), ("multi", 1.0)):
        paths += [timed(f"{tag}_full", [10] * 3), timed(f"{tag}_transplant", [1] * 3),
                  timed(f"{tag}_limit", [0.8] * 3), timed(f"{tag}_limit_engine", [engine_s] * 3)]
    row = engine.summarize(2000, paths, {})
    assert row["limit_path"] == "engine" and row["limit_speedup"] == pytest.approx(20)
    assert row["limit_bare_speedup"] == pytest.approx(12.5) and row["transplant_share_of_limit"] == pytest.approx(0.5)
    assert row["multiblock_limit_path"] == "bare" and row["multiblock_share_of_limit"] == pytest.approx(0.8)


def test_the_limit_counts_the_forward_over_a_cache_held_in_place():
    """Both the bare and the engine path copy the whole cache once; `extend_into` over buffers that
    already hold it does not. When it is the fastest, it is the limit."""
    paths = [timed("prefill", [10] * 3), timed("extend1", [0.3] * 3), timed("extend1_inplace", [0.2] * 3),
             timed("erratum", [1.0] * 3), timed("erratum_inplace", [0.9] * 3)]
    for tag in ("one", "multi"):
        paths += [timed(f"{tag}_full", [10] * 3), timed(f"{tag}_transplant", [1] * 3),
                  timed(f"{tag}_limit", [0.8] * 3), timed(f"{tag}_limit_engine", [0.6] * 3),
                  timed(f"{tag}_limit_inplace", [0.4] * 3)]
    row = engine.summarize(2000, paths, {})
    assert row["limit_path"] == "inplace" and row["limit_speedup"] == pytest.approx(25)
    assert row["transplant_limit_inplace_speedup"] == pytest.approx(25)
    assert row["transplant_share_of_limit"] == pytest.approx(0.4)
    assert row["extend1_inplace_ratio"] == pytest.approx(0.02) and "ext1 inpl" in engine.table([row])
    assert row["erratum_inplace_ratio"] == pytest.approx(0.09) and "err inpl" in engine.table([row])


def test_gemm_pass_runs_every_decoder_linear_once_at_the_given_rows():
    m = tiny_model("llama")
    seen = []
    layers = m.adapter.layers(m.hf)
    hooks = [mod.register_forward_hook(lambda mod, i, o: seen.append((type(mod).__name__, tuple(i[0].shape))))
             for mod in [*layers.modules(), m.hf.get_output_embeddings()] if isinstance(mod, torch.nn.Linear)]
    workloads.gemm_pass(m, 7)()
    for h in hooks:
        h.remove()
    n_linear = sum(isinstance(mod, torch.nn.Linear) for mod in layers.modules())
    assert len(seen) == n_linear + 1  # and the LM head, on the last row only
    assert all(shape[1] == 7 for _, shape in seen[:-1]) and seen[-1][1][1] == 1


def test_edit_paths_time_one_token_through_transformers_alone_with_the_same_logits():
    m = tiny_model("llama")
    paths, info = workloads.edit_paths(m, 700, with_map=False)
    by = {p.name: p for p in paths}
    assert {"prefill", "extend1", "extend1_bare", "extend1_gemms", "extend1_copy", "extend1_inplace", "erratum",
            "erratum_inplace", "erratum_gemms"} <= set(by)
    engine.run_rounds(paths, reps=2, warmup=0, device=m.device)  # each call gets a fresh bare cache
    ours, bare = by["extend1"].last.logits[0, -1], by["extend1_bare"].last
    assert (ours - bare).abs().max().item() <= ATOL_FP32
    assert torch.equal(by["extend1_inplace"].last.logits, by["extend1"].last.logits)  # no copy, same forward
    erratum, inplace = by["erratum"].last.logits, by["erratum_inplace"].last.logits[0, -1]
    assert torch.equal(inplace, erratum) and info["erratum_inplace_max_abs_diff"] == 0.0
    assert 0 < info["erratum_floor"] < 1


def test_cpu_facts_name_the_model_and_its_bf16_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
                    "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert provenance.cpu_model(info) == {"model": "Some Xeon", "flags": ["avx2", "avx512f", "amx_bf16"]}
    assert provenance.cpu_model(tmp_path / "absent") == {"model": None, "flags": []}


def test_rounds_interleave_after_warmup():
    order = []
    paths = [workloads.Timed(n, lambda n=n: order.append(n)) for n in "abc"]
    engine.run_rounds(paths, reps=2, warmup=1, device=torch.device("cpu"))
    assert order == list("abc") + list("bca") + list("cab")
    assert all(len(p.times) == 2 for p in paths)


def test_profile_writes_the_operator_table_of_the_profiled_paths(tmp_path):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    paths = [workloads.Timed("erratum", lambda: a @ b), workloads.Timed("prefill", lambda: a + b),
             workloads.Timed("full_downstream", lambda: torch.softmax(a @ b, -1))]
    tops = engine.profile_paths(paths, 2000, tmp_path / "prof", top=3)
    assert set(tops) == {"erratum", "full_downstream"}  # prefill is not profiled
    assert any("mm" in e["op"] for e in tops["erratum"])
    assert any("softmax" in e["op"] for e in tops["full_downstream"])
    assert all(0 <= e["self_cpu_share"] <= 1 for t in tops.values() for e in t) and len(tops["erratum"]) <= 3
    assert sorted(f.name for f in (tmp_path / "prof").iterdir()) == ["L2000_erratum.txt", "L2000_full_downstream.txt"]
    assert "Self CPU" in (tmp_path / "prof" / "L2000_erratum.txt").read_text()


def test_extra_seams_get_their_own_speedup_share_and_the_flop_ceiling(tmp_path):
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    prefix, question = torch.randint(0, 128, (5,), generator=g).tolist(), torch.randint(0, 128, (6,), generator=g).tolist()
    blocks = [torch.randint(0, 128, (12,), generator=g).tolist() for _ in range(3)]
    paths, info = workloads._composed(m, tmp_path, prefix, blocks, question, "multi", (0, 1))
    names = {p.name for p in paths}
    assert {"multi_transplant", "multi_transplant_k0", "multi_transplant_k1", "multi_limit"} <= names
    assert info["multi_seam_tokens"] == 3 * workloads.SEAM
    assert 0 < info["multi_flop_ceiling"] < 1  # the seams are work the limit does not do
    assert -1 <= info["multi_cosine_k0"] <= 1 and info["multi_cosine_k1"] <= 1 + 1e-6

    def timed(name, t):
        return workloads.Timed(name, lambda: None, times=[t] * 3)

    row = engine.summarize(100, [timed("multi_full", 10), timed("multi_limit", 1), timed("multi_transplant", 2),
                                 timed("multi_transplant_k0", 1.25), timed("multi_transplant_k1", 1.6)], {})
    assert row["multiblock_k0_speedup"] == pytest.approx(8) and row["multiblock_k0_share_of_limit"] == pytest.approx(0.8)
    assert row["multiblock_k1_share_of_limit"] == pytest.approx(1 / 1.6)
    assert row["multiblock_share_of_limit"] == pytest.approx(0.5)


def test_kvboost_side_by_side_reads_the_worker_after_its_warm_up_item(monkeypatch):
    from experiments.shared import kvboost as _kvboost

    m = tiny_model("llama")
    monkeypatch.setattr(workloads, "multiblock_prompt", lambda model, n: ([1, 2], [[3, 4, 5], [6, 7, 8]], [9, 10]))
    seen = {}

    def fake_worker(python, model, confs, items, chunk_size, timeout_s):
        seen["items"], seen["confs"] = items, confs
        ref = torch.tensor([1.0, 2.0, 3.0])
        times = {"baseline": 2.0, "none": 0.1, "selective": 0.5, "cacheblend": 2.5}
        res, logits = [], {}
        for it in items:
            slow = 100.0 if it["key"] == "r0" else 1.0  # the warm-up item: dropped
            for conf in ("baseline", *confs):
                mode = conf.split("_")[-1]
                t = times[mode] * (0.5 if conf.startswith("blk_") else 1.0)
                res.append({"key": it["key"], "config": conf, "ttft_s": t * slow, "reported_ttft_ms": 1000 * t,
                            "kv_reuse_ratio": 0.9, "approximate_hits": int(confs.get(conf, {}).get("warm") == "chunks")})
                logits[(it["key"], conf)] = ref if mode != "none" else torch.tensor([1.0, 2.0, 2.0])
        return res, logits

    monkeypatch.setattr(_kvboost, "run_worker", fake_worker)
    row = workloads.kvboost_multiblock(m, 100, "/nowhere/python", reps=3)
    assert [it["key"] for it in seen["items"]] == ["r0", "r1", "r2", "r3"]
    assert row["kvboost_full_s"] == pytest.approx(2.0)
    assert row["kvboost_none_speedup"] == pytest.approx(20) and row["kvboost_cacheblend_speedup"] == pytest.approx(0.8)
    assert row["kvboost_selective_cosine"] == pytest.approx(1.0) and row["kvboost_none_cosine"] < 1
    # today's driving (per-chunk warm, 64) beside kvboost's documented setup and one chunk per block
    assert set(seen["confs"]) == {f"{t}{m}" for t in ("", "doc_", "blk_") for m in ("none", "selective", "cacheblend")}
    assert seen["confs"]["doc_none"]["chunk_size"] == 128 and seen["confs"]["doc_none"]["engine"]["overlap_k"] == 16
    assert seen["confs"]["blk_selective"]["chunk_size"] == 3 and seen["confs"]["blk_none"]["warm"] == "context"
    assert row["kvboost_blk_none_speedup"] == pytest.approx(40) and row["kvboost_doc_none_speedup"] == pytest.approx(20)
    assert row["kvboost_none_cacheblend_forced"] and not row["kvboost_blk_none_cacheblend_forced"]
    assert row["kvboost_blk_none_reported_speedup"] == pytest.approx(40)

def _shape_folder(tmp_path, config):
    from kvnotes.models.tiny import tiny_tokenizer

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(str(tmp_path))
    return tmp_path


def test_random_init_checks_an_8b_shape_before_building_it(tmp_path, capsys, monkeypatch):
    """Llama-3.1-8B at 8k: refused on a 16 GiB device, accepted on 80 GiB, with no weights built
    for the check; a folder without a config is a one-line error."""
    from benchmarks.shapes import SHAPES
    from kvnotes.measure import timing
    from kvnotes.models import tiny

    folder = _shape_folder(tmp_path / "l8b", SHAPES["llama-3.1-8b"])
    built = []
    real = tiny.random_model

    def spy(f, device="auto", dtype="auto", seed=0):
        built.append(device)
        if device != "meta":
            raise RuntimeError("weights built")
        return real(f, device=device, dtype=dtype, seed=seed)

    monkeypatch.setattr(tiny, "random_model", spy)
    argv = ["--model", str(folder), "--random-init", "--dtype", "bfloat16", "--device", "cpu", "--lengths", "8000"]
    monkeypatch.setattr(timing, "available_bytes", lambda d: 16 * 2**30)
    assert engine.main(argv) == 2 and built == ["meta"]
    err = capsys.readouterr().err
    assert err.startswith("error: estimated peak memory") and "does not fit" in err and err.count("\n") == 1
    monkeypatch.setattr(timing, "available_bytes", lambda d: 80 * 2**30)
    with pytest.raises(RuntimeError, match="weights built"):
        engine.main(argv)
    assert built == ["meta", "meta", "cpu"]
    assert engine.main(["--model", str(tmp_path), "--random-init"]) == 2
    assert "is not a folder with a config.json" in capsys.readouterr().err


def test_random_model_builds_the_folders_architecture_with_its_tokenizer(tmp_path):
    from kvnotes.models.loading import weights_id
    from kvnotes.models.tiny import random_model, tiny_config

    cfg = tiny_config("qwen3").to_dict()
    folder = _shape_folder(tmp_path, cfg)
    m = random_model(str(folder), device="cpu", seed=3)
    assert m.adapter.family == "qwen3" and m.dtype == torch.float32 and m.checksum.startswith("fingerprint:")
    assert m.checksum != random_model(str(folder), device="cpu", seed=4).checksum
    assert m.checksum == weights_id(random_model(str(folder), device="cpu", seed=3))
    ids = m.tokenizer("a short prompt", return_tensors="pt").input_ids
    assert torch.isfinite(run.full_logits(m, ids)).all()


def test_attribution_is_timed_beside_the_exact_map_as_ratios_to_one_prefill():
    paths = [timed("prefill", [10, 10, 10]), timed("map", [20, 20, 20]), timed("attribution", [0.5, 0.5, 0.5])]
    row = engine.summarize(1000, paths, {})
    assert row["attribution_ratio"] == pytest.approx(0.05) and row["map_ratio"] == pytest.approx(2.0)
    assert row["map_over_attribution"] == pytest.approx(40.0)
    assert "attrib" in engine.table([row])
    m = tiny_model("llama")
    paths, info = workloads.edit_paths(m, 700, with_map=False, with_attribution=True)
    by = {p.name: p for p in paths}
    assert {"prefill", "map", "attribution"} <= set(by) and info["map_positions"] > 0
    engine.run_rounds([by["attribution"]], reps=1, warmup=0, device=m.device)
    assert by["attribution"].last.shape[0] == info["edit_tokens"] - 1  # [pos, layer, kv_head] of the cache
    assert engine.parse_args(["--attribution"]).attribution


def test_in_place_and_tier_paths_run_and_agree_with_the_transplant(tmp_path):
    m = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    prefix, question = torch.randint(0, 128, (5,), generator=g).tolist(), torch.randint(0, 128, (6,), generator=g).tolist()
    blocks = [torch.randint(0, 128, (12,), generator=g).tolist() for _ in range(2)]
    paths, info = workloads._composed(m, tmp_path, prefix, blocks, question, "one", (0,), tiers=True)
    by = {p.name: p for p in paths}
    assert {"one_inplace", "one_inplace_k0", "one_tier_host", "one_tier_disk", "one_tier_disk_warm"} <= set(by)
    assert info["one_inplace_max_abs_diff"] <= ATOL_FP32 and info["one_host_pinned"] is False
    ref = by["one_transplant"].fn()
    for name in ("one_inplace", "one_tier_host", "one_tier_disk", "one_tier_disk_warm"):
        if by[name].setup is not None:
            by[name].setup()
        assert (by[name].fn() - ref).abs().max().item() <= ATOL_FP32, name


def test_summary_reads_in_place_shares_and_tier_speedups():
    def timed(name, t):
        return workloads.Timed(name, lambda: None, times=[t] * 3)

    row = engine.summarize(100, [timed("one_full", 10), timed("one_limit", 1), timed("one_transplant", 2),
                                 timed("one_inplace", 1.25), timed("one_tier_host", 1.25),
                                 timed("one_tier_disk", 5), timed("one_tier_disk_warm", 2.5),
                                 timed("multi_full", 10), timed("multi_limit", 1),
                                 timed("multi_transplant_k0", 2), timed("multi_inplace_k0", 1.1)], {})
    assert row["inplace_share_of_limit"] == pytest.approx(0.8)
    assert row["tier_device_speedup"] == pytest.approx(8) and row["tier_host_speedup"] == pytest.approx(8)
    assert row["tier_disk_speedup"] == pytest.approx(2) and row["tier_disk_warm_speedup"] == pytest.approx(4)
    assert row["multiblock_k0_share_of_limit"] == pytest.approx(1 / 1.1)
    assert row["multiblock_k0_transplant_share_of_limit"] == pytest.approx(0.5)
    assert "inpl/lim" in engine.table([row]) and "k0 tp/lim" in engine.table([row])
