"""kvnotes.engine.causal: every branch equals attention written out (repeated keys, explicit mask)."""

import pytest
import torch
from tolerances import ATOL_FP32
from torch import nn

from kvnotes.engine import causal


def _reference(q, k, v, allowed, scale):
    """softmax(q k^T * scale + mask) v with keys repeated per query head; [b, q, h, d]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


@pytest.mark.parametrize("p,q", [(0, 1), (0, 9), (5, 1), (3, 12), (12, 3), (20, 20)])
@pytest.mark.parametrize("window", [None, 4, 100])
@pytest.mark.parametrize("heads,kv", [(4, 2), (3, 3), (6, 1)])
def test_every_branch_matches_the_written_out_attention(p, q, window, heads, kv):
    g = torch.Generator().manual_seed(p * 100 + q)
    b, d = 2, 8
    query = torch.randn(b, heads, q, d, generator=g)
    key, value = (torch.randn(b, kv, p + q, d, generator=g) for _ in range(2))
    allowed = causal.causal_allowed(q, p + q, window, torch.device("cpu"))
    out, _ = causal.causal_attention(nn.Module(), query, key, value, None, scaling=d**-0.5,
                                     sliding_window=window, **{causal.MEMO: {}})
    want = _reference(query, key, value, allowed, d**-0.5)
    assert out.shape == (b, q, heads, d)
    assert (out - want).abs().max().item() <= ATOL_FP32


@pytest.mark.parametrize("additive", [False, True])
def test_a_given_mask_is_applied_once_per_forward(additive):
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 8, generator=g)
    key, value = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(2))
    allowed = torch.rand(3, 10, generator=g) > 0.4
    allowed[:, 0] = True  # no empty row
    mask = allowed if not additive else torch.zeros(3, 10).masked_fill(~allowed, torch.finfo(torch.float32).min)
    memo: dict = {}
    out, _ = causal.causal_attention(nn.Module(), query, key, value, mask[None, None],
                                     scaling=0.3, **{causal.MEMO: memo})
    assert (out - _reference(query, key, value, allowed, 0.3)).abs().max().item() <= ATOL_FP32
    assert len(memo) == 1  # the tiled mask is kept for the other layers of the forward


def test_per_head_masks_and_softcap_are_refused():
    x = torch.zeros(1, 2, 2, 4)
    with pytest.raises(ValueError, match="shared by all heads"):
        causal.causal_attention(nn.Module(), x, x, x, torch.ones(1, 2, 2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="soft-cap"):
        causal.causal_attention(nn.Module(), x, x, x, None, softcap=30.0)
