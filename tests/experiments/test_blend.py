"""Cache blending: selection rules (kvnotes.compose.blend), experiment `blend` on a tiny model with the real
llama tokenizer (skills, memory notes, the LoCoMo fixture), kvboost's output parsing, the figure.

Exactness anchors: recomputing every block token (CacheBlend at r = 1) is a full prefill; seam
repair by `transplant` equals recomputing the seam positions; layer-0 keys carry no context, so a
correct rotation leaves no key deviation there.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from run_folders import seal
from tolerances import ATOL_FP32

import runner.main as runner
from kvnotes.compose import blend
from kvnotes.compose import splice as kcompose
from kvnotes.compose.blend import Layout, Method
from kvnotes.engine import run as krun
from kvnotes.models import wrap_model
from kvnotes.models.tiny import tiny_model
from runner.config import ConfigError, validate
from runner.rundir import RecordWriter

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_mini.json"
TINY = ["model.name=tiny-llama", "model.tiny_family=llama", "progress=false"]
SMALL = ["experiment.n_items=2", f"experiment.locomo_path={FIXTURE}", "experiment.locomo_blocks=2",
         "experiment.memory_blocks=3", "experiment.memory_block_tokens=60", "experiment.skills_length=420",
         "experiment.verify_probes=1", "experiment.seams=[1,4,10000]", "experiment.budgets=[0.15,1.0]",
         "experiment.n_boot=100"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def model(tiny_llama_vocab):
    """A tiny random llama over the real llama tokenizer's vocabulary (conftest)."""
    return tiny_llama_vocab


def layout(tok, texts=("ab, cd.\nef gh\n", "ij kl;\nmn. op qr st\n", "uv wx\nyz")) -> Layout:
    enc = lambda s: tuple(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    return Layout(enc("System: notes.\n"), tuple(enc(t) for t in texts), enc("\nQ: which? A:"))


# --- kvnotes.compose.blend --------------------------------------------------------------------------------


def test_layout_and_budget_rules():
    lay = Layout((1, 2), ((3, 4, 5), (6,)), (7,))
    assert lay.starts == [2, 5] and lay.n_block_tokens == 4 and lay.block_positions() == [2, 3, 4, 5]
    assert lay.ids == [1, 2, 3, 4, 5, 6, 7] and lay.context == [1, 2, 3, 4, 5, 6]
    assert blend.seam_positions(lay, 2) == [2, 3, 5]
    assert [blend.budget(20, f) for f in (0.0, 0.01, 0.15, 0.5, 1.0)] == [0, 1, 3, 10, 20]
    assert blend.spread(list(range(10)), 3) == [1, 5, 8] and blend.spread([4, 5], 5) == [4, 5]
    for bad in (lambda: Layout((), (), (1,)), lambda: Layout((), ((1,),), ()),
                lambda: blend.budget(3, 1.5), lambda: Method("apes"), lambda: Method("seam", 1.5),
                lambda: Method("cacheblend", 0.0), lambda: blend.seam_positions(lay, -1)):
        with pytest.raises(ValueError):
            bad()
    assert [Method("seam", 4).name, Method("notes", 0.15).name, Method("naive").name] == ["seam@4", "notes@15%", "naive"]


def test_cacheblend_picks_the_most_deviated_block_tokens_only():
    lay = Layout((0, 0), ((1, 1, 1), (1, 1, 1, 1)), (2,))
    dev = torch.tensor([9.0, 9.0, 0.1, 5.0, 0.2, 0.3, 4.0, 0.0, 1.0, 9.0])  # head and tail high
    assert blend.cacheblend_positions(dev, lay, 2 / 7) == [3, 6]


def test_note_positions_prefer_newlines_then_punctuation_per_block(tiny):
    tok = tiny.tokenizer
    lay = layout(tok)
    cls = [blend.aggregator_class(tok, b) for b in lay.blocks]
    picked = blend.note_positions(tok, lay, 0.2)
    for start, blk, c in zip(lay.starts, lay.blocks, cls):
        mine = [p - start for p in picked if start <= p < start + len(blk)]
        assert len(mine) <= blend.budget(len(blk), 0.2)
        assert all(c[i] < 2 for i in mine)  # aggregators only
        newlines = [i for i, x in enumerate(c) if x == 0]
        assert set(newlines[: len(mine)]) <= set(mine) or set(mine) <= set(newlines)
    everything = blend.note_positions(tok, lay, 1.0)
    assert len(everything) == sum(x < 2 for c in cls for x in c)  # capped by the aggregators
    hybrid = blend.note_positions(tok, lay, 0.2, seam=2)
    for start, blk in zip(lay.starts, lay.blocks):
        mine = [p for p in hybrid if start <= p < start + len(blk)]
        k = blend.budget(len(blk), 0.2)
        assert mine[:2] == [start, start + 1][:k] and len(mine) == k
    assert Method("notes", 0.15, seam=2).name == "notes+seam2@15%"
    with pytest.raises(ValueError):
        Method("cacheblend", 0.15, seam=2)


def test_recomputing_every_block_token_is_a_full_prefill(tiny):
    lay = layout(tiny.tokenizer)
    head = krun.prefill(tiny, list(lay.head)).cache
    blocks = [kcompose.prefill_block(tiny, list(b)) for b in lay.blocks]
    built = blend.build(tiny, lay, head, blocks, Method("cacheblend", 1.0))
    assert built.recomputed == lay.n_block_tokens and built.checked == len(lay.context)
    assert built.cache.max_abs_diff(krun.prefill(tiny, lay.context).cache) <= 10 * ATOL_FP32
    naive = blend.build(tiny, lay, head, blocks, Method("naive"))
    assert naive.recomputed == 0 and naive.cache.max_abs_diff(built.cache) > 1e-3


def test_seam_repair_equals_recomputing_the_seam_positions(tiny):
    lay = layout(tiny.tokenizer)
    head = krun.prefill(tiny, list(lay.head)).cache
    blocks = [kcompose.prefill_block(tiny, list(b)) for b in lay.blocks]
    seam = blend.build(tiny, lay, head, blocks, Method("seam", 3))
    naive = kcompose.transplant(tiny, head, blocks, 0)
    again = krun.recompute(tiny, naive, lay.context, blend.seam_positions(lay, 3))
    assert seam.recomputed == 9 and seam.cache.max_abs_diff(again) <= 10 * ATOL_FP32


def test_key_deviation_is_zero_where_nothing_is_stale(tiny):
    lay = layout(tiny.tokenizer)
    head = krun.prefill(tiny, list(lay.head)).cache
    naive = kcompose.transplant(tiny, head, [kcompose.prefill_block(tiny, list(b)) for b in lay.blocks], 0)
    d0 = blend.key_deviation(tiny, naive, lay.context, 0)  # layer 0 keys see no context
    d1 = blend.key_deviation(tiny, naive, lay.context, 1)
    n_head = len(lay.head)
    assert d0.shape == (len(lay.context),) and d0.max() < 1e-4
    assert d1[:n_head].max() < 1e-4 and d1[n_head + 1 :].max() > 1e-3
    with pytest.raises(ValueError):
        blend.key_deviation(tiny, naive, lay.context, tiny.n_layers)


def test_prefill_at_matches_a_rotation(tiny):
    from kvnotes.engine import rope

    ids = [5, 9, 11, 40, 3]
    moved = rope.reposition(tiny, krun.prefill(tiny, ids).cache, 17)
    assert krun.prefill_at(tiny, ids, 17).max_abs_diff(moved) <= ATOL_FP32


# --- experiment blend ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def hydra_ready():
    runner.prepare()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


def context(tmp_path: Path, model, *overrides: str):
    cfg = compose("config", overrides=["+experiment=blend", f"results_dir={tmp_path}", *TINY, *SMALL, *overrides])
    return runner.Context(validate(cfg), model, RecordWriter(tmp_path), tmp_path)


def test_config_validates_and_refuses_bad_values():
    job = validate(compose("config", overrides=["+experiment=blend", *TINY, f"experiment.locomo_path={FIXTURE}"]))
    assert job.params.seams == [1, 2, 4, 8, 16, 32] and job.params.budgets == [0.05, 0.10, 0.15, 0.20, 0.30]
    names = [m.name for m in job.params.methods()]
    assert names[:3] == ["naive", "seam@1", "seam@2"]
    for r in (5, 10, 15, 20):  # the repair selectors beside CacheBlend at every budget
        assert {f"cacheblend@{r}%", f"attribution@{r}%", f"query_aware@{r}%", f"notes@{r}%"} <= set(names)
    for bad in ("experiment.workloads=[rag]", "experiment.budgets=[0.0]", "experiment.seams=[0]",
                "experiment.kvboost.ratios=[2.0]", "experiment.timing_repeats=0"):
        with pytest.raises(ConfigError):
            validate(compose("config", overrides=["+experiment=blend", *TINY, f"experiment.locomo_path={FIXTURE}", bad]))
    ok = validate(compose("config", overrides=["+experiment=blend", *TINY, "experiment.workloads=[skills]",
                                               "experiment.locomo_path=/no/such/file"]))
    ok.params.check_inputs()  # locomo is not read
    missing = validate(compose("config", overrides=["+experiment=blend", *TINY, "experiment.locomo_path=/no/such/file"]))
    with pytest.raises(ConfigError, match="locomo_path"):
        missing.params.check_inputs()



def _as_run_dir(root: Path, ctx, stamp: str) -> Path:
    """A finished clean run folder (as the runner leaves it) of a context the test ran."""
    import json

    from omegaconf import OmegaConf

    d = root / "blend" / "tiny-llama" / stamp
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(OmegaConf.to_yaml(ctx.cfg))
    (d / "meta.json").write_text(json.dumps({"status": "completed", "start_time": stamp, "end_time": stamp,
                                             "git": {"commit": "0123456789abcdef", "dirty": False},
                                             "attempts": [{"git_commit": "0123456789abcdef", "dirty": False}]}))
    ctx.writer.read().to_parquet(d / "records.parquet", index=False)
    (d / "summary.json").write_text(json.dumps({"finished": stamp}))
    return seal(d)


def test_shards_of_a_sliced_run_merge_into_the_whole_run(tmp_path, model, monkeypatch):
    """item_slice runs a shard of the items built; runner.merge joins shards into the run they split:
    the same records (timings aside), the verify record once, and the summary over every item."""
    import pandas as pd

    from analysis import reference
    from experiments import blend as exp
    from runner.merge import merge_runs

    monkeypatch.setattr(reference, "in_history", lambda commit, where: True)
    over = ("experiment.workloads=[skills]", "experiment.n_items=3", "experiment.seams=[4]",
            "experiment.budgets=[0.15]", "experiment.note_seams=[0]")
    runs = {}
    for tag, sl in (("whole", None), ("a", "[0,1]"), ("b", "[1,3]")):
        ctx = context(tmp_path / tag, model, *over, *([f"experiment.item_slice={sl}"] if sl else []))
        exp.run(ctx)
        runs[tag] = (ctx, _as_run_dir(tmp_path / "runs" / tag, ctx, f"2026-01-0{len(runs) + 1}_00-00-00"))
    assert runs["a"][0].writer.read()["item_id"].nunique() == 1
    merged_dir = merge_runs([runs["a"][1], runs["b"][1]])
    assert merged_dir.parent == runs["a"][1].parent  # a new run beside its shards
    dest = reference.copy_run(merged_dir, tmp_path / "ref")  # and copied like any run
    merged, whole = pd.read_parquet(dest / "records.parquet"), runs["whole"][0].writer.read()
    cols = ["unit", "item_id", "name", "cosine", "task_score", "recomputed"]
    key = ["unit", "name"]
    assert (merged[merged["kind"] == "blend"][cols].sort_values(key).reset_index(drop=True)
            .equals(whole[whole["kind"] == "blend"][cols].sort_values(key).reset_index(drop=True)))
    assert (merged["unit"] == "verify").sum() == (whole["unit"] == "verify").sum()
    summary = json.loads((dest / "summary.json").read_text())
    assert summary["workloads"]["skills"]["n_items"] == 3
    meta = json.loads((dest / "meta.json").read_text())
    assert [m["item_slice"] for m in meta["merged_from"]] == [[0, 1], [1, 3]]
    with pytest.raises(ConfigError, match="overlap"):
        merge_runs([runs["b"][1], runs["b"][1]])
    with pytest.raises(ConfigError, match="item_slice"):
        validate(compose("config", overrides=["+experiment=blend", *TINY, "experiment.n_items=3",
                                              "experiment.item_slice=[2,5]"]))

def test_a_missing_locomo_file_fails_before_any_work(tmp_path, model, monkeypatch):
    from experiments import blend as exp
    from kvnotes.compose import verify

    monkeypatch.setattr(verify, "verify", lambda *a, **k: pytest.fail("verification ran"))
    with pytest.raises(ConfigError, match="locomo_path"):
        exp.run(context(tmp_path, model, "experiment.locomo_path=/no/such/locomo.json"))


@pytest.fixture(scope="module")
def blend_run(model, tmp_path_factory):
    from experiments import blend as exp

    tmp = tmp_path_factory.mktemp("blend")
    ctx = context(tmp, model)
    exp.run(ctx)
    return ctx, ctx.writer.read()


def test_every_method_on_every_item(blend_run):
    ctx, df = blend_run
    rows = df[df["kind"] == "blend"]
    assert set(rows["workload"]) == {"skills", "memory", "locomo"}
    names = {"full", "naive", "seam@1", "seam@4", "seam@10000", "cacheblend@15%", "cacheblend@100%",
             "notes@15%", "notes@100%", "notes+seam2@15%", "notes+seam2@100%", "attribution@15%",
             "attribution@100%", "query_aware@15%", "query_aware@100%"}
    for _, g in rows.groupby("item_id"):
        assert set(g["name"]) == names
    full = rows[rows["name"] == "full"]
    assert (full["cosine"] == 1.0).all() and (full["recompute_fraction"] == 1.0).all()
    # a seam covering every block and CacheBlend at r = 1 are full recomputes: exact agreement
    for name in ("seam@10000", "cacheblend@100%", "attribution@100%", "query_aware@100%"):
        r = rows[rows["name"] == name]
        assert (r["cosine"] > 0.99999).all() and r["decision_agree"].all() and (r["recompute_fraction"] == 1.0).all()
        assert (r["task_score"] == r["task_score_full"]).all()
    s4 = rows[rows["name"] == "seam@4"]
    assert (s4["recomputed"] == s4["n_blocks"] * 4).all()  # blocks are longer than 4 tokens
    cb = rows[rows["name"] == "cacheblend@15%"]
    assert ((cb["recompute_fraction"] - 0.15).abs() < 0.02).all() and (cb["checked"] == cb["n_context"]).all()
    for name, checked in (("attribution@15%", cb["n_context"].to_numpy()), ("query_aware@15%", 0)):
        r = rows[rows["name"] == name]
        assert ((r["recompute_fraction"] - 0.15).abs() < 0.02).all() and (r["checked"].to_numpy() == checked).all()
    notes = rows[rows["name"] == "notes@15%"]
    assert (notes["recompute_fraction"] <= 0.15 + 0.02).all() and (notes["recomputed"] > 0).all()
    assert set(rows.loc[rows["name"] == "notes+seam2@15%", "method"]) == {"notes+seam2"}
    dec = rows[rows["workload"] != "locomo"]
    assert (dec["decision"] != "").all() and (dec["answer"] == "").all()
    assert (loc_answers := rows.loc[rows["workload"] == "locomo", "answer"]).str.len().gt(0).any(), loc_answers
    assert (rows["ttft_ratio"] > 0).all() and rows["time_full_s"].notna().all()
    loc = rows[rows["workload"] == "locomo"]
    assert (loc["n_blocks"] == 2).all() and loc["task_score"].between(0, 1).all()
    ver = df[df["kind"] == "verify"]
    assert len(ver) == 1 and bool(ver.iloc[0]["go"])


def test_summary_has_cis_and_a_frontier(blend_run):
    from experiments import blend as exp

    ctx, df = blend_run
    s = exp.summarize(df.to_dict("records"), ctx.params)
    assert s["verify"]["go"]
    for w in ("skills", "memory", "locomo"):
        out = s["workloads"][w]
        assert out["n_items"] >= 1
        m = out["methods"]["cacheblend@15%"]
        assert {"mean", "ci_lo", "ci_hi", "n"} <= set(m["cosine"]) and m["top1_agree"]["n"] == out["n_items"]
        assert set(out["frontier"]) == {"0.15", "1"}
        assert m["task_delta"]["ci_cluster"]["interval"] == "cluster-bootstrap"
        assert "cacheblend@15%" == out["versus_cacheblend"]["15%"]["cacheblend"]
        best = out["frontier"]["1"]["cosine"]
        assert best["name"] in ("seam@10000", "cacheblend@100%") and best["value"] > 0.99999
        assert out["frontier"]["0.15"]["cosine"]["recompute_fraction"] <= 0.15 + exp.BUDGET_TOL


def test_frontier_prefers_the_cheaper_method_on_a_tie():
    from experiments.blend import frontier

    stat = lambda m, x, c: {"method": m, "recompute_fraction": x, "cosine": {"mean": c},  # noqa: E731
                            "task_score": {"mean": 1.0}}
    ms = {"a": stat("seam", 0.1, 0.9), "b": stat("notes", 0.05, 0.95), "c": stat("cacheblend", 0.3, 0.99),
          "d": stat("cacheblend", 0.1504, 0.96), "full": stat("full", 1.0, 1.0)}
    f = frontier(ms, [0.05, 0.15, 1.0])
    assert f["0.05"]["cosine"]["name"] == "b" and f["0.15"]["cosine"]["name"] == "d"  # 15 % rounded up
    assert f["1"]["cosine"]["name"] == "c" and f["1"]["task_score"]["name"] == "b"


def test_versus_cacheblend_pairs_items_and_resamples_conversations():
    import pandas as pd

    from experiments.blend import clusters_of, versus_cacheblend

    rng = np.random.default_rng(0)
    rows = []
    for conv in range(6):
        for q in range(4):
            base = float(rng.uniform(0.2, 0.6))
            for name, score in (("cacheblend@15%", base), ("attribution@15%", base + 0.3),
                                ("query_aware@15%", base), ("notes@5%", 1.0)):
                rows.append({"item_id": f"locomo/conv-{conv}/q{q:03d}", "workload": "locomo", "domain": "single-hop",
                             "name": name, "task_score": score, "cosine": 0.9})
    df = pd.DataFrame(rows)
    assert clusters_of(df.head(2)) == ["conv-0", "conv-0"]
    v = versus_cacheblend(df, n_boot=200)
    assert set(v) == {"15%"} and set(v["15%"]["methods"]) == {"attribution@15%", "query_aware@15%"}
    att = v["15%"]["methods"]["attribution@15%"]
    assert att["n"] == 24 and att["task_score"]["mean"] == pytest.approx(0.3)
    assert att["task_score"]["ci_cluster"]["n_clusters"] == 6
    assert v["15%"]["beats"] == ["attribution@15%"]  # a tie (query_aware) does not beat it
    assert v["15%"]["beats_disjoint"] == ["attribution@15%"]


def test_no_go_stops_the_run_unless_forced(tmp_path, model, monkeypatch):
    from experiments import blend as exp
    from kvnotes.compose import verify

    bad = verify.Report("tiny-llama", "llama", "float32", True, verify.THRESHOLDS["float32"],
                        reasons=["rope offset_rel 1.0e+00 > 0.001"])
    monkeypatch.setattr(verify, "_VERDICTS", weakref.WeakKeyDictionary({model.hf: {(str(model.dtype), str(model.device)): bad}}))
    ctx = context(tmp_path / "a", model, "experiment.workloads=[skills]", "experiment.n_items=1")
    with pytest.raises(verify.NoGoError, match="offset_rel"):
        exp.run(ctx)
    ver = ctx.writer.read()
    assert list(ver["kind"]) == ["verify"] and not bool(ver.iloc[0]["go"])
    forced = context(tmp_path / "b", model, "experiment.workloads=[skills]", "experiment.n_items=1",
                     "experiment.force=true")
    exp.run(forced)
    df = forced.writer.read()
    assert bool(df[df["kind"] == "verify"].iloc[0]["verify_forced"]) and (df["kind"] == "blend").any()


# --- workloads -------------------------------------------------------------------------------------


def test_memory_notes_hold_the_fact_in_a_varying_block(model):
    from experiments.shared.workloads import memory_items

    items = memory_items(model.tokenizer, True, 8, 4, 60, 0)
    tok = model.tokenizer
    places = set()
    for it in items:
        assert len(it.layout.blocks) == 4 and it.correct_id in it.decision_ids
        holder = [j for j, b in enumerate(it.layout.blocks) if f"{it.meta['domain']}:" in tok.decode(b)]
        assert holder == [it.meta["target_block"]]
        places.add(holder[0])
    assert len(places) > 1


def test_locomo_items_hold_the_evidence_sessions(model):
    from experiments.shared.workloads import locomo_items

    items = locomo_items(str(FIXTURE), model.tokenizer, True, 10, 2, 400, 0)
    assert items and all(len(it.layout.blocks) == 2 and it.gold for it in items)
    assert all(set(it.meta["evidence_sessions"]) <= set(it.meta["sessions"]) for it in items)
    assert len({it.item_id for it in items}) == len(items)
    assert not locomo_items(str(FIXTURE), model.tokenizer, True, 10, 3, 400, 0)  # no conversation has 3


# --- kvboost ---------------------------------------------------------------------------------------


def test_kvboost_rows_score_its_output_against_its_baseline(model):
    from experiments.shared.kvboost import KvboostConfig, kvboost_configs, kvboost_rows
    from experiments.shared.workloads import BlendItem

    lay = layout(model.tokenizer)
    item = BlendItem("x/0", "skills", lay, decision_ids=(5, 9), correct_id=9)
    ids = list(lay.ids)
    base = torch.zeros(model.config.vocab_size)
    base[9] = 3.0
    worse = base.clone()
    worse[5] = 4.0
    common = {"key": "i0", "ids": ids, "n_context": len(lay.context), "reported_ttft_ms": 100.0,
              "output_text": "", "kv_reuse_ratio": 0.5, "cached_tokens": 8, "warmed_chunks": 2}
    res = [{**common, "config": "baseline", "ttft_s": 2.0, "cached_tokens": 0, "approximate_hits": 0},
           {**common, "config": "selective@16", "ttft_s": 1.0, "approximate_hits": 1},
           {**common, "config": "cacheblend@15%", "ttft_s": 3.0, "approximate_hits": 0}]
    logits = {("i0", "baseline"): base, ("i0", "selective@16"): base.clone(), ("i0", "cacheblend@15%"): worse}
    rows = kvboost_rows(model, [item], res, logits, kvboost_configs(KvboostConfig()))
    sel, cb = rows
    assert sel["cacheblend_forced"] and sel["method"] == "kvboost-selective" and sel["setting"] == 16
    assert sel["cosine"] == pytest.approx(1.0) and sel["task_score"] == 1.0 and sel["ttft_ratio"] == 0.5
    assert sel["recompute_fraction"] == 1.0  # forced cacheblend re-prefills every cached token
    assert not cb["decision_agree"] and cb["task_score"] == 0.0 and cb["ttft_ratio"] == 1.5
    assert sel["same_tokens"] and -1 <= sel["cosine_vs_ours"] <= 1


def _kvboost_python() -> Path | None:
    import os

    for p in (os.environ.get("KVBOOST_PYTHON"), ROOT / ".venv-kvboost/bin/python", "/tmp/kvboost-venv/bin/python"):
        if p and Path(p).exists():
            return Path(p)
    return None


@pytest.mark.skipif(_kvboost_python() is None, reason="no kvboost venv (.venv-kvboost or $KVBOOST_PYTHON)")
def test_kvboost_worker_runs_as_it_ships(model, tmp_path):
    from experiments.shared.kvboost import kvboost_records
    from experiments.shared.workloads import skills_items

    folder = tmp_path / "tiny"
    model.hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    m = wrap_model(model.hf, model.tokenizer, name="tiny-llama")
    m.source_path = str(folder)
    ctx = context(tmp_path, m, "experiment.workloads=[skills]", "experiment.n_items=1",
                  f"experiment.kvboost.python={_kvboost_python()}", "experiment.kvboost.chunk_size=32")
    items = skills_items(m.tokenizer, True, 1, 420, 0)
    rows = kvboost_records(m, items, ctx.params.kvboost, ctx.params.max_new_tokens)
    assert {r["name"] for r in rows} == {"kvboost selective@16", "kvboost cacheblend@15%"}
    for r in rows:
        assert r["kv_reuse_ratio"] > 0 and r["time_s"] > 0 and -1 <= r["cosine"] <= 1
        assert r["baseline_cosine_vs_ours"] > 0.9999  # its baseline is our full prefill


# --- the figure ------------------------------------------------------------------------------------


def test_figure_draws_every_method_and_states_the_frontier(blend_run, tmp_path):
    from run_folders import write_run

    from analysis import load
    from analysis.figures import Skip
    from analysis.figures import blend as fig

    _, df = blend_run
    write_run(tmp_path / "runs", "blend", "llama", "2026-01-02_00-00-00", df.to_dict("records"), kind="experiment")
    frame = load.load(tmp_path / "runs")
    paths = fig.make(frame, tmp_path / "figs")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    d = frame[(frame["job"] == "blend") & (frame["kind"] == "blend") & (frame["workload"] == "skills")]
    text = fig.frontier_text(d, "cosine", [0.15, 1.0])
    assert text.startswith("15%: ") and "100%: " in text
    with pytest.raises(Skip):
        fig.make(frame.iloc[:0], tmp_path / "none")


def test_repeated_timing_is_torch_benchmark_timers_median_and_keeps_the_first_result(monkeypatch):
    """timing_repeats > 1: the first call's result, and torch.utils.benchmark.Timer's median per-call
    time of the further calls (one path's calls back to back, no setup between: Timer's case)."""
    import time as _time

    import torch.utils.benchmark as benchmark

    from experiments import blend as exp_blend

    made = []

    class Counted(benchmark.Timer):
        def __init__(self, *a, **k):
            made.append(k.get("stmt", a[0] if a else None))
            super().__init__(*a, **k)

    monkeypatch.setattr(exp_blend.benchmark, "Timer", Counted)
    calls = []

    def fn():
        calls.append(1)
        _time.sleep(0.02)
        return len(calls)

    out, seconds = exp_blend._timed(fn, 3, torch.device("cpu"))
    assert out == 1 and made == ["fn()"] and len(calls) >= 3
    assert 0.015 < seconds < 0.2
    calls.clear()
    assert exp_blend._timed(fn, 1, torch.device("cpu"))[0] == 1 and len(calls) == 1 and len(made) == 1
