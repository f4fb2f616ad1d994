"""The composition experiments on a tiny random model with a real tokenizer, configs, LoCoMo.

With a seam as long as the block, a transplant is a full recompute, so every "composed vs full"
comparison must be exact there: that pins the bookkeeping (segments, offsets, errata, the
incremental agent) independently of how good a random model's transplants are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import runner.main as runner
from kvnotes.tasks import locomo
from runner.config import ConfigError, validate
from runner.rundir import RecordWriter

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "locomo_mini.json"
TINY = ["model.name=tiny-llama", "model.tiny_family=llama", "progress=false"]
NAMES = ["compose", "compose_scaling", "agent", "memory"]
EXACT = 10_000  # a seam longer than any block: the transplant is a full recompute
NO_GATE = ["experiment.gate.required=false", "experiment.gate.n_blocks=1"]


@pytest.fixture(scope="module", autouse=True)
def hydra_ready():
    runner.prepare()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        yield


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Every test here runs tiny models on one torch thread (conftest `one_thread`)."""


@pytest.fixture(scope="module")
def model(tiny_llama_vocab):
    """A tiny random llama over the real llama tokenizer's vocabulary (conftest)."""
    return tiny_llama_vocab


def context(tmp_path: Path, model, name: str, *overrides: str):
    cfg = compose("config", overrides=[f"+experiment={name}", f"results_dir={tmp_path}", *TINY,
                                       *overrides])
    return runner.Context(validate(cfg), model, RecordWriter(tmp_path), tmp_path)


def records(ctx) -> list[dict]:
    return ctx.writer.read().to_dict("records")


# --- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_config_composes_and_validates(tmp_path, name):
    job = validate(compose("config", overrides=[f"+experiment={name}", *TINY]))
    assert job.name == name and job.params.gate.required is True
    with pytest.raises(ConfigError):
        validate(compose("config", overrides=[f"+experiment={name}", *TINY,
                                              "experiment.gate.threshold=2.0"]))


@pytest.mark.parametrize("override", ["experiment.lengths=[]", "experiment.repeats=0",
                                      "experiment.seam=-1", "experiment.threads=0"])
def test_scaling_config_refuses_bad_values(override):
    with pytest.raises(ConfigError):
        validate(compose("config", overrides=["+experiment=compose_scaling", *TINY, override]))


def test_compose_config_refuses_negative_seams():
    with pytest.raises(ConfigError, match="seams"):
        validate(compose("config", overrides=["+experiment=compose", *TINY, "experiment.seams=[-1]"]))


# --- compose ------------------------------------------------------------------------------------


def test_compose_experiment_seam_curve(tmp_path, model):
    from experiments import compose as exp

    ctx = context(tmp_path, model, "compose", "experiment.n_items=2", f"experiment.seams=[0,2,{EXACT}]",
                  "experiment.n_boot=50", *NO_GATE)
    exp.run(ctx)
    rows = records(ctx)
    fid = [r for r in rows if r["kind"] == "fidelity"]
    assert len(fid) == 6 and {r["seam"] for r in fid} == {0, 2, EXACT}
    floor = [r for r in rows if r["kind"] == "floor"]
    assert len(floor) == 2 and all(r["cosine"] > 1 - 1e-5 for r in floor)
    assert len([r for r in rows if r["kind"] == "gate"]) == 2  # 1 block x 2 gate seams
    for r in fid:
        if r["seam"] == EXACT:
            assert r["cosine"] > 1 - 1e-5 and r["kl"] < 1e-6 and r["decision_agree"]
    summary = exp.summarize(rows, ctx.params)
    assert set(summary["seams"]) == {"0", "2", str(EXACT)}
    assert summary["seams"]["0"]["cosine"]["n"] == 2 and "gate" in summary
    assert summary["n_items"] == 2 and len(summary["domains"]) == 2
    assert summary["noise_floor"]["cosine"]["n"] == 2


def test_split_item_puts_blocks_between_head_and_question(model):
    from experiments.compose import split_item
    from kvnotes.tasks import build_suite

    item = build_suite("skills", tokenizer=model.tokenizer, n_items=1, length=600, seed=0)[0]
    head, blocks, tail = split_item(item)
    assert len(blocks) == 3 and head + [i for _, b in blocks for i in b] + tail == list(item.old_ids)
    assert all(name.startswith("skill:") for name, _ in blocks)


def test_gate_failure_stops_the_run(tmp_path, model):
    from experiments import compose as exp

    ctx = context(tmp_path, model, "compose", "experiment.gate.threshold=1.0",
                  "experiment.gate.n_blocks=1")
    with pytest.raises(RuntimeError, match="composition gate failed"):
        exp.run(ctx)


# --- compose_scaling ----------------------------------------------------------------------------


def test_scaling_one_length_and_summary(tmp_path, model):
    from experiments import compose_scaling as exp

    ctx = context(tmp_path, model, "compose_scaling", "experiment.lengths=[48,96]",
                  "experiment.repeats=1", f"experiment.extra_seams=[0,{EXACT}]",
                  "experiment.n_boot=50", "experiment.threads=1", *NO_GATE)
    exp.run(ctx)
    rows = records(ctx)
    t = [r for r in rows if r["kind"] == "timing"]
    assert len(t) == 2 * 7  # lengths x (full, transplant@4, limit, limit_engine, limit_inplace, @0, @EXACT)
    assert not list((tmp_path / "store").glob("*.safetensors"))  # not kept by default
    exact = [r for r in t if r["path"] == "transplant" and r["seam"] == EXACT]
    assert all(r["cosine"] > 1 - 1e-5 and r["first_token_agree"] for r in exact)
    for path in ("limit", "limit_engine", "limit_inplace"):  # transformers, kvnotes (copy, in place)
        limit = [r for r in t if r["path"] == path]
        assert len(limit) == 2 and all(r["cosine"] > 1 - 1e-5 and r["first_token_agree"] for r in limit)
    summary = exp.summarize(rows, ctx.params)
    for n in ("48", "96"):
        row = summary["lengths"][n]
        for key in ("full_prefill_s", "transplant_s", "limit_s", "speedup", "limit_speedup"):
            assert row[key] > 0
        assert row["n_repeats"] == 1 and row["kv_mb"] > 0 and row["store_mb"] > 0
        ways = {"bare": row["limit_bare_s"], "engine": row["limit_engine_s"], "inplace": row["limit_inplace_s"]}
        assert row["limit_s"] == min(ways.values()) and ways[row["limit_path"]] == row["limit_s"]
        assert f"transplant_s@{EXACT}" in row and "paper_speedup" in row
        assert set(row["transplant_parts_s"]) == {"load_s", "splice_question_s"}


def test_skill_ids_have_the_exact_length(model):
    from experiments.compose_scaling import skill_ids

    for n in (50, 700):
        assert len(skill_ids(model.tokenizer, "refund", n, seed=0)) == n


def test_scaling_end_to_end_through_hydra(tmp_path):
    cfg = compose("config", overrides=["+experiment=compose_scaling", f"results_dir={tmp_path}",
                                       *TINY, "device=cpu", "experiment.lengths=[40]",
                                       "experiment.repeats=1", "experiment.n_boot=20", *NO_GATE])
    path = runner.run(cfg)
    summary = json.loads((path / "summary.json").read_text())
    assert set(summary["lengths"]) == {"40"} and summary["lengths"]["40"]["speedup"] > 0


# --- agent ----------------------------------------------------------------------------------------


def test_agent_with_exact_seam_agrees_with_the_same_prompt(tmp_path, model):
    from experiments import agent as exp

    ctx = context(tmp_path, model, "agent", "experiment.n_scenarios=2", "experiment.n_turns=3",
                  "experiment.block_length=40", f"experiment.seam={EXACT}", "experiment.n_boot=50",
                  *NO_GATE)
    exp.run(ctx)
    turns = [r for r in records(ctx) if r["kind"] == "turn"]
    assert len(turns) == 6
    for r in turns:  # transplanted + appended == a full prefill of the same erratum prompt
        assert r["cosine_erratum"] > 1 - 1e-5 and r["agree_erratum"]
        assert r["latency_ratio"] > 0 and r["new_tokens"] <= r["n_tokens"]
    later = [r for r in turns if r["turn"] > 0]
    assert all(r["new_tokens"] < r["n_tokens"] // 2 for r in later)  # only the appended part
    summary = exp.summarize(records(ctx), ctx.params)
    assert summary["overall"]["agreement"]["n"] == 6 and summary["n_scenarios"] == 2


def test_common_prefix():
    from experiments.agent import common_prefix

    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


# --- memory and LoCoMo --------------------------------------------------------------------------


def test_memory_synthetic_exact_seam(tmp_path, model):
    from experiments import memory as exp

    ctx = context(tmp_path, model, "memory", "experiment.n_items=2", f"experiment.seam={EXACT}",
                  "experiment.n_boot=50", *NO_GATE)
    exp.run(ctx)
    rows = [r for r in records(ctx) if r["kind"] == "synthetic"]
    assert len(rows) == 12
    exact = {("transplant", "full_old"), ("transplant_erratum", "full_erratum"),
             ("transplant_edit", "full_new")}
    for r in rows:
        if (r["condition"], r["reference"]) in exact:
            assert r["cosine"] > 1 - 1e-5 and r["decision_agree"], r
    summary = exp.summarize(records(ctx), ctx.params)
    assert summary["synthetic"]["transplant_erratum vs full_new"]["decision_agree"]["n"] == 2


def test_memory_locomo_fixture(tmp_path, model):
    from experiments import memory as exp

    ctx = context(tmp_path, model, "memory", "experiment.n_items=0", f"experiment.seam={EXACT}",
                  f"experiment.locomo_path={FIXTURE}", "experiment.locomo_max_tokens=90",
                  "experiment.max_new_tokens=3", "experiment.n_boot=50", *NO_GATE)
    exp.run(ctx)
    rows = [r for r in records(ctx) if r["kind"] == "locomo"]
    assert rows and {r["conversation"] for r in rows} <= {"mini-1", "mini-2"}
    assert all(r["answer_agree"] and r["cosine"] > 1 - 1e-5 for r in rows)
    assert all(r["memory_len"] <= 90 for r in rows)
    summary = exp.summarize(records(ctx), ctx.params)
    assert summary["locomo"]["n_questions"] == len(rows)
    assert summary["locomo"]["answer_agree"]["mean"] == 1.0


def test_memory_f1_delta_carries_a_conversation_cluster_interval():
    from experiments import memory as exp

    # 3 conversations, their questions alike: the conversation bootstrap is the wider interval
    rows = [{"kind": "locomo", "conversation": c, "question_index": q, "memory_len": 80, "answer_agree": True,
             "f1_full": 0.5, "f1_transplant": 0.5 + d + 0.01 * q, "cosine": 1.0, "top1_agree": True}
            for c, d in (("c1", -0.3), ("c2", 0.0), ("c3", 0.2)) for q in range(6)]
    cfg = exp.MemoryConfig(n_boot=500)
    delta = exp.summarize(rows, cfg)["locomo"]["f1_delta"]
    cl = delta["ci_cluster"]
    assert cl["cluster"] == "conversation" and cl["n_clusters"] == 3 and cl["n"] == 18
    assert cl["ci_hi"] - cl["ci_lo"] > delta["ci_hi"] - delta["ci_lo"]
    one = exp.summarize([r | {"conversation": "c1"} for r in rows], cfg)["locomo"]["f1_delta"]["ci_cluster"]
    assert math.isnan(one["ci_lo"]) and "1 cluster" in one["why"]


def test_locomo_loader_reads_the_official_format():
    convs = locomo.load(FIXTURE)
    assert [c.sample_id for c in convs] == ["mini-1", "mini-2"]
    c = convs[0]
    assert c.speakers == ("Ada", "Ben") and [s.index for s in c.sessions] == [1, 2]
    assert c.n_turns == 7 and "grey cat sleeping" in c.sessions[0].turns[2].text
    qs = locomo.questions(c)
    assert len(qs) == 5 and all(q.category in locomo.ANSWERABLE for q in qs)  # adversarial out
    assert qs[-1].answer == "2024"  # numeric answers read as text
    assert not [q for q in c.qa if q.category == 5][0].answerable


def test_locomo_memory_budget_keeps_only_covered_questions(model):
    c = locomo.load(FIXTURE)[0]
    tok = model.tokenizer
    whole = locomo.render_memory(c)
    assert len(whole.dia_ids) == 7 and "# Session 2 (6:30 pm on 20 April, 2024)" in whole.text
    cut = locomo.render_memory(c, tok, 70)
    n = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in cut.pieces)
    assert n <= 70 and 0 < len(cut.dia_ids) < 7
    covered = locomo.questions(c, cut.dia_ids)
    assert all(set(q.evidence) <= cut.dia_ids for q in covered)
    assert len(covered) < len(locomo.questions(c, whole.dia_ids))


def test_locomo_f1_and_format_errors(tmp_path):
    assert locomo.f1("7 May, 2023", "7 may 2023") == 1.0
    assert locomo.f1("the cello", "cello") == 1.0 and locomo.f1("piano", "cello") == 0.0
    assert 0 < locomo.f1("cello in May", "cello, 12 May") < 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(locomo.LocomoFormatError, match="list"):
        locomo.load(bad)
    bad.write_text(json.dumps([{"qa": [], "conversation": {"speaker_a": "A"}}]))
    with pytest.raises(locomo.LocomoFormatError, match="session"):
        locomo.load(bad)


@pytest.mark.slow
def test_real_llama_seam_curve_one_item(llama):
    from experiments.compose import fidelity
    from kvnotes.tasks import build_suite

    item = build_suite("skills", tokenizer=llama.tokenizer, n_items=1, length=400, seed=0)[0]
    rows = {r["seam"]: r for r in fidelity(llama, item, [0, 4, EXACT])}
    assert rows[EXACT]["cosine"] > 1 - 1e-5 and rows[EXACT]["decision_agree"]
    assert rows[0]["cosine"] > 0.7 and rows[4]["cosine"] > rows[0]["cosine"]
