"""analysis.order_section and analysis.localize_section: tables and readings from real summaries
(experiments.order.summarize, experiments.shared.localize_summary.summarize_sets on synthetic records)."""

import json
import math

import pandas as pd

from analysis.localize_section import localize_section
from analysis.order_section import matches, order_section
from experiments.order import OrderConfig, summarize
from experiments.shared.localize_summary import summarize_sets


def _row(pair, o, c, s, field, notes):
    return {"pair_id": f"g/{pair}", "domain": f"d{pair % 4}", "order": o, "content": c, "stretch": s,
            "stretch_tokens": s - 3, "n_tokens": 400 + s, "margin": 1.0, "abs_delta": 2.0, "usable": True,
            "field_only": field, "notes_only": notes, "full_downstream": 1.0}


def _order_rows(after_task_field=False):
    rows = []
    for i in range(16):
        j = 0.01 * (i % 3)
        for s in (64, 256):
            rows += [_row(i, "field_before_rule", "task", s, 0.05 + j, 0.9 - j),
                     _row(i, "field_before_rule", "filler", s, 0.1 + j, 0.8 - j),
                     _row(i, "field_after_rule", "filler", s, 0.85 - j, 0.1 + j),
                     _row(i, "field_after_rule", "task", s, *((0.8 - j, 0.2) if after_task_field else (0.1 + j, 0.8)))]
    return rows


def _write(tmp_path, job, model, summary):
    d = tmp_path / job / model / "2026-01-01_00-00-00"
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(summary))
    return {"job": job, "run_id": f"{job}/{model}/2026-01-01_00-00-00", "model": model, "run_path": str(d)}


def test_order_section_shows_every_cell_with_both_intervals_and_reads_h1(tmp_path):
    s = summarize(_order_rows(), OrderConfig(n_boot=200, stretches=[64, 256]))
    text = "\n".join(order_section(pd.DataFrame([_write(tmp_path, "order", "qwen-1.5b", s)])))
    assert text.startswith("## Field/rule order x what follows them x stretch")
    assert "written before any order run was read" in text
    assert text.count("| before rule | task | 64") == 1 and "(4 domains)" in text
    assert "the pattern matches H1 at every (order, content)" in text
    assert order_section(pd.DataFrame([{"job": "patching", "run_id": "x", "model": "llama", "run_path": "."}])) == []


def test_order_reading_names_the_rival_the_pattern_favours():
    s = summarize(_order_rows(after_task_field=True), OrderConfig(n_boot=200, stretches=[64, 256]))
    assert s["per_order_content"]["field_after_rule/task"]["verdict"] == "against"
    assert "as the rival H1' predicts" in matches(s["per_order_content"])


def _set_rows(item, k80):
    rows = []
    for k in range(1, 9):
        rec = min(1.0, k / k80 * 0.8)
        for rk in ("heldout", "in_sample", "random"):
            rows.append({"condition": "set", "band": "all", "item_id": item, "ranking": rk, "k": k,
                         "recovery": rec if rk != "random" else 0.01 * k, "n_ranked": 100, "n_unaligned": 4,
                         "added": [k], "added_segments": ["request" if k % 2 else "rule"],
                         "added_classes": ["content"], "added_attended": [True]})
    return rows


def test_localize_section_shows_topk_the_k80_set_and_the_reading(tmp_path):
    records = [r for i, k80 in (("a", 2), ("b", 4), ("c", 8)) for r in _set_rows(i, k80)]
    s = summarize_sets(records, ks=[1, 2, 4, 8], threshold=0.8, paper_top8=[0.74, 0.79], n_boot=200)
    text = "\n".join(localize_section(pd.DataFrame([_write(tmp_path, "localize", "qwen-1.5b", s)]), "f/loc.png"))
    assert "| heldout | " in text and "| top-1 | top-2 | top-4 | top-8 |" in text
    assert "reached on 3/3" in text and "with at most 16 positions on 3/3" in text
    assert "its size over the items that reach it: median 4 (quartiles" in text
    assert "| request |" in text and "| rule |" in text and "![localize](f/loc.png)" in text
    assert "the paper, in sample, 0.74-0.79" in text and s["reading"] in text
    assert not math.isnan(s["top8"]["heldout"]["mean"])


def test_localize_summary_and_section_carry_the_domain_cluster_interval(tmp_path):
    # two domains, items alike within a domain and apart between them: the cluster interval is the wider
    records = [r | {"domain": d} for i, d, k80 in (("a", "x", 2), ("b", "x", 2), ("c", "x", 2), ("d", "y", 8),
                                                   ("e", "y", 8), ("f", "y", 8)) for r in _set_rows(i, k80)]
    s = summarize_sets(records, ks=[1, 8], threshold=0.8, paper_top8=[0.74, 0.79], n_boot=200)
    for cell in (s["topk"]["heldout"][1], s["top8"]["heldout"], s["top8"]["in_sample_minus_heldout"],
                 s["k80"]["le_16"], s["k80_set"]["attended_share"]):
        assert cell["ci_cluster"]["cluster"] == "domain" and cell["ci_cluster"]["n_clusters"] == 2
        c = cell["ci_cluster"]
        wide = c if c["ci_hi"] - c["ci_lo"] > cell["ci_hi"] - cell["ci_lo"] else cell
        assert cell["verdict_ci"] == [wide["ci_lo"], wide["ci_hi"]]
    top1 = s["topk"]["heldout"][1]
    assert top1["ci_cluster"]["ci_hi"] - top1["ci_cluster"]["ci_lo"] > top1["ci_hi"] - top1["ci_lo"]
    assert top1["verdict_ci"] == [top1["ci_cluster"]["ci_lo"], top1["ci_cluster"]["ci_hi"]]
    text = "\n".join(localize_section(pd.DataFrame([_write(tmp_path, "localize", "qwen-1.5b", s)])))
    assert "domain cluster bootstrap" in text and text.count("(domain cluster [") >= 4

