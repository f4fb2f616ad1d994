"""Which block tokens CacheBlend recomputes (kvnotes.compose.blend): the key deviation at the check layer,
the budget's rounding, and the top-k over block positions only, each against a value computed
here independently (known perturbations of the keys, a plain HF prefill, a sort of the deviation).
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import prefill_kv
from tolerances import ATOL_FP32

from kvnotes.compose import blend
from kvnotes.compose import splice as compose
from kvnotes.compose.blend import Layout, Method
from kvnotes.engine import run
from kvnotes.engine.cache import KVCache


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models on one torch thread (conftest `one_thread`)."""


def random_layout(seed: int = 0, sizes=(8, 6, 7)) -> Layout:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: tuple(torch.randint(7, 128, (n,), generator=g).tolist())  # noqa: E731
    return Layout(ids(4), tuple(ids(n) for n in sizes), ids(3))


def top_block_positions(dev: torch.Tensor, layout: Layout, k: int) -> list[int]:
    """The k block positions (all context after the head) of largest deviation, by a plain sort
    (no ties in these tests)."""
    cand = range(len(layout.head), len(layout.head) + sum(len(b) for b in layout.blocks))
    return sorted(sorted(cand, key=lambda p: -float(dev[p]))[:k])


def test_budget_rounds_half_up_and_keeps_one_token_for_any_positive_fraction():
    cases = {(5, 0.5): 3, (10, 0.25): 3, (7, 0.5): 4, (10, 0.24): 2, (10, 0.04): 1, (3, 1e-9): 1,
             (20, 0.15): 3, (21, 0.3): 6, (8, 1.0): 8, (8, 0.0): 0, (0, 0.5): 0}
    assert {key: blend.budget(*key) for key in cases} == cases  # 2.5 -> 3, not banker's 2
    for bad in (-0.1, 1.01):
        with pytest.raises(ValueError, match="fraction"):
            blend.budget(10, bad)


@pytest.mark.parametrize("fraction", [0.01, 0.15, 0.3, 0.5, 1.0])
def test_selection_is_the_top_k_of_the_deviation_over_block_positions(fraction):
    lay = random_layout()  # head 0..3, blocks 4..11, 12..17, 18..24; the tail is not cached
    g = torch.Generator().manual_seed(1)
    dev = torch.rand(len(lay.context), generator=g)  # distinct values: no ties
    dev[: len(lay.head)] = 100.0  # the head deviates most, but is cached exactly: never chosen
    got = blend.cacheblend_positions(dev, lay, fraction)
    k = blend.budget(lay.n_block_tokens, fraction)
    assert len(got) == k == max(1, int(fraction * 21 + 0.5))
    assert got == top_block_positions(dev, lay, k)
    blocks = set(range(4, 25))
    assert lay.block_positions() == list(range(4, 25)) and lay.starts == [4, 12, 18]
    assert got == sorted(got) and set(got) <= blocks and len(set(got)) == k
    if k < len(blocks):  # whatever is left out deviates less than everything chosen
        assert max(float(dev[p]) for p in blocks - set(got)) < min(float(dev[p]) for p in got)


def test_key_deviation_reads_a_known_perturbation_at_the_check_layer_only(tiny):
    lay = random_layout(2)
    ctx = lay.context
    clean = run.prefill(tiny, ctx).cache
    layer, bumps = 1, {5: 0.5, 13: 2.0, 20: 1.25}
    keys = [k.clone() for k in clean.keys]
    for p, size in bumps.items():
        keys[layer][0, 1, p, 3] += size  # one entry: the L2 deviation is exactly `size`
    keys[2][0, 0, 9, 0] += 7.0  # another layer: invisible at the check layer
    reused = KVCache(tuple(keys), clean.values)
    dev = blend.key_deviation(tiny, reused, ctx, layer)
    want = torch.zeros(len(ctx))
    want[list(bumps)] = torch.tensor(list(bumps.values()))
    assert dev.shape == (len(ctx),) and (dev - want).abs().max().item() <= 1e-4
    assert blend.cacheblend_positions(dev, lay, 3 / 21) == sorted(bumps)
    assert blend.cacheblend_positions(dev, lay, 1 / 21) == [13]
    with pytest.raises(ValueError, match="check layer"):
        blend.key_deviation(tiny, reused, ctx, tiny.n_layers)
    with pytest.raises(ValueError, match="positions"):
        blend.key_deviation(tiny, reused, ctx[:-1], layer)


@pytest.mark.parametrize(("fraction", "check_layer"), [(0.3, 1), (0.15, 2)])
def test_build_recomputes_the_block_tokens_whose_reused_keys_deviate_most(tiny, fraction, check_layer):
    """The naive transplant's keys against a plain HF prefill's, at the check layer: the largest
    deviations (block tokens only) are the positions `build` recomputes."""
    lay = random_layout(3)
    head = run.prefill(tiny, list(lay.head)).cache
    blocks = [compose.prefill_block(tiny, list(b)) for b in lay.blocks]
    naive = compose.transplant(tiny, head, blocks, 0)
    fresh = prefill_kv(tiny, lay.context)[check_layer][0]  # [1, kv_head, pos, d_head]
    dev = (fresh - naive.keys[check_layer]).pow(2).sum(dim=(0, 1, 3)).sqrt()  # [pos]
    assert dev[: len(lay.head)].max() <= 1e-4 and dev[len(lay.head) + 1 :].min() > 1e-4
    k = blend.budget(lay.n_block_tokens, fraction)
    want = top_block_positions(dev, lay, k)
    built = blend.build(tiny, lay, head, blocks, Method("cacheblend", fraction, check_layer=check_layer))
    assert built.recomputed == k and built.checked == len(lay.context)
    assert built.cache.max_abs_diff(run.recompute(tiny, naive, lay.context, want)) <= ATOL_FP32
    others = top_block_positions(-dev, lay, k)  # the least deviated instead: another cache
    assert built.cache.max_abs_diff(run.recompute(tiny, naive, lay.context, others)) > 1e-3
