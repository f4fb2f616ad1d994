"""Negative positions count from the end of the cache wherever positions are accepted (Python and
TransformerLens habit, issue #34); past either end is one IndexError line with the valid range."""

import pytest
import torch

from kvnotes.edit.strategies import Editor
from kvnotes.engine import run
from kvnotes.engine.cache import absolute_positions, patch
from kvnotes.engine.variants import read_variants
from kvnotes.models.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def caches(model):
    g = torch.Generator().manual_seed(0)
    a, b = (run.prefill(model, torch.randint(0, 128, (1, 12), generator=g)).cache for _ in range(2))
    return a, b


def test_absolute_positions():
    assert absolute_positions([-1, 0, -12, 11], 12).tolist() == [11, 0, 0, 11]
    with pytest.raises(IndexError, match=r"^position -13 out of range for a cache of 12 positions \(valid: "
                                         r"0\.\.11, or -12\.\.-1 from the end"):
        absolute_positions([3, -13], 12)
    with pytest.raises(IndexError, match="position 12 out of range"):
        absolute_positions([12], 12)


def test_patch_and_select_count_from_the_end(caches):
    a, b = caches
    assert patch(a, b, [-1, -3]).max_abs_diff(patch(a, b, [11, 9])) == 0.0
    assert a.select([-1]).max_abs_diff(a.slice(11)) == 0.0
    with pytest.raises(IndexError, match="out of range"):
        patch(a, b, [-13])


def test_read_variants_and_recompute_count_from_the_end(model, caches):
    a, b = caches
    neg = read_variants(model, a, b, [[-1], [-2, -5]], [7])
    pos = read_variants(model, a, b, [[11], [10, 7]], [7])
    assert torch.equal(neg, pos)
    ids = list(range(20, 32))
    assert run.recompute(model, a, ids, [-1, 3]).max_abs_diff(run.recompute(model, a, ids, [3, 11])) == 0.0
    got = run.recompute_extend(model, a, ids, [-2], [7]).logits
    assert torch.equal(got, run.recompute_extend(model, a, ids, [10], [7]).logits)
    with pytest.raises(IndexError, match="position -13 out of range for a cache of 12 positions"):
        run.recompute(model, a, ids, [-13])


def test_editor_selective_counts_from_the_end(model):
    from kvnotes import tasks

    item = tasks.build_suite("gated", model.tokenizer, chat=False, n_items=1, length=700, seed=0)[0]
    ed = Editor(model, item)
    n = ed.stale.seq_len
    neg, pos = ed.selective([-1, -4]), ed.selective([n - 1, n - 4])
    assert torch.equal(neg.logits, pos.logits) and neg.recomputed == pos.recomputed
