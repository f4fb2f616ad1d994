"""Probes scrub and split on a tiny model: their readings against the patching probe and against
exact composition, and their errors before any forward."""

import pytest

from kvnotes import tasks
from kvnotes.models.tiny import tiny_model
from probes import patching as locality
from probes import scrub, split


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def items(model):
    return tasks.build_suite("gated", model.tokenizer, chat=False, n_items=2, length=700, seed=0)


def test_scrub_note_and_rest_partition_the_changed_span(model, items):
    # attended with top_fraction 1: note = every downstream position (notes-only), rest = the field
    cfg = scrub.ScrubConfig(margin=0.0, notes=["attended", "aggregators"], top_fraction=1.0, n_random=2)
    recs = scrub.run(model, items, cfg)
    pat = locality.run(model, items, locality.PatchingConfig(margin=0.0, per_position=False, per_layer=False))
    def score(rows, **eq):
        return next(r["score"] for r in rows if all(r.get(k) == v for k, v in eq.items()))

    for item in items:
        i = item.item_id
        assert score(recs, item_id=i, condition="note", notes="attended") == pytest.approx(
            score(pat, item_id=i, condition="notes_only"), abs=1e-5)
        assert score(recs, item_id=i, condition="rest", notes="attended") == pytest.approx(
            score(pat, item_id=i, condition="field_only"), abs=1e-5)
        agg = [r for r in recs if r["item_id"] == item.item_id and r.get("notes") == "aggregators"]
        n_note = next(r["n_positions"] for r in agg if r["condition"] == "note")
        n_rest = next(r["n_positions"] for r in agg if r["condition"] == "rest")
        assert n_note == len([p for p in item.aggregators if item.field_span[1] <= p < item.n_tokens - 1])
        assert n_note + n_rest == item.n_tokens - 1 - item.field_span[0]
    s = scrub.summarize(recs, cfg)
    assert {"note", "rest", "random", "interaction", "note_minus_random"} <= set(s["aggregators"])
    assert s["aggregators"]["random"]["n"] <= 2  # draws averaged per item
    assert "aggregators: note" in s["reading"] and "(paper 0.79 vs 0.19)" in s["reading"]


def test_split_with_full_seam_repair_is_exact_and_without_it_is_not(model, items):
    cfg = split.SplitConfig(seams=[0, 10_000])
    recs = split.run(model, items, cfg)
    assert len(recs) == 2 * 2 * 2 * 2  # items x prompts x seams x modes
    exact = [r for r in recs if r["seam"] == 10_000]
    assert all(r["agree"] and r["cosine"] == pytest.approx(1.0, abs=1e-5) for r in exact)
    split0 = [r for r in recs if r["seam"] == 0 and r["condition"] == "split"]
    assert all(r["n_blocks"] == 2 and r["cosine"] < 0.9999 for r in split0)
    s = split.summarize(recs, cfg)
    assert s["n_prompts"] == 4 and s["seams"]["10000"]["split"]["agreement"]["mean"] == 1.0
    assert s["seams"]["10000"]["split"]["agreement"]["ci_lo"] < 1.0  # Wilson, not zero width
    assert s["seams"]["0"]["agreement_single_minus_split"]["n"] == 4
    assert s["reading"].startswith("seam 0: agreement with a full prefill") and "seam 10000: agreement" in s["reading"]


def test_split_refuses_items_without_the_segments_before_any_forward(model):
    items = tasks.build_suite("memory", model.tokenizer, chat=False, n_items=1, seed=0)
    with pytest.raises(ValueError, match="needs a gated suite"):
        split.run(model, items, split.SplitConfig())
    with pytest.raises(ValueError, match="seams"):
        split.SplitConfig(seams=[-1])
