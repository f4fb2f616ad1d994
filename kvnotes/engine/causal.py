"""Causal attention over a cache without the costs of an explicit mask, exact.

A forward that extends a cache of p tokens by q new ones reads the bottom-right causal pattern:
new token t (position p + t) sees keys 0..p + t. transformers builds it as an explicit
[q, p + q] mask whenever p > 0 and q > 1, and an explicit mask costs three times over: SDPA can
no longer skip the masked triangle (the whole q x (p + q) square is computed, up to 2x the
attention of a prefill), grouped-query keys are repeated once per query head, and a boolean mask
is converted to an additive one in every layer. Here the same attention is computed, choosing
per call the cheapest exact form:

* q = 1: one query reads every key, no mask; the g query heads of a kv group are packed as g
  query rows of that kv head ([B, kv, g, d]), so keys are never repeated;
* p < q (a prefill when p = 0): p zero queries are put in front, which turns the pattern into
  SDPA's top-left `is_causal` over a square, and their rows are dropped; (p + q)^2 / 2 scores;
* p >= q, or a mask given by the caller (the recompute path's arbitrary positions): one additive
  mask, built once per forward, with the kv group's query heads packed as rows (the mask tiled
  g times); q (p + q) scores, and no repeated keys.

Sliding-window layers whose window is shorter than the keys take the explicit-mask form, with
the window applied by position (cache index = position in kvnotes caches).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

NAME = "kvnotes_causal"
MEMO = "kvnotes_memo"  # forward kwarg: a dict that lives for one forward (masks built once)


def _pack(query: Float[Tensor, "b h q d"], kv: int) -> Float[Tensor, "b kv gq d"]:
    """Query head h = k * g + j (transformers' repeat_kv order) becomes row j * q + t of kv head k."""
    b, h, q, d = query.shape
    return query.reshape(b, kv, (h // kv) * q, d)


def _unpack(out: Float[Tensor, "b kv gq d"], h: int, q: int) -> Float[Tensor, "b q h d"]:
    b, kv, _, d = out.shape
    return out.reshape(b, h, q, d).transpose(1, 2).contiguous()  # [b, q, h, d] as attention returns


def causal_allowed(q: int, kv: int, window: int | None, device: torch.device) -> Tensor:
    """Bottom-right causal [q, kv] (and |position difference| < window when given)."""
    qpos = torch.arange(kv - q, kv, device=device)[:, None]
    kpos = torch.arange(kv, device=device)[None, :]
    ok = kpos <= qpos
    if window is not None:
        ok = ok & (qpos - kpos < window)
    return ok


def _additive(mask: Tensor, dtype: torch.dtype, g: int) -> Tensor:
    """[.., q, kv] bool or additive -> additive [1 or b, 1, g * q, kv] in `dtype`, tiled per packed row."""
    if mask.dtype == torch.bool:
        add = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        add = add.masked_fill(~mask, torch.finfo(dtype).min)
    else:
        add = mask.to(dtype)
    while add.ndim < 4:
        add = add[None]
    return add.repeat(1, 1, g, 1) if g > 1 else add


def _memo(kwargs: dict[str, Any], key: tuple[Any, ...], build: Any) -> Tensor:
    memo = kwargs.get(MEMO)
    if memo is None:
        return build()
    if key not in memo:
        memo[key] = build()
    return memo[key]


def causal_attention(
    module: nn.Module,
    query: Float[Tensor, "batch head q d_head"],
    key: Float[Tensor, "batch kv_head kv d_head"],
    value: Float[Tensor, "batch kv_head kv d_head"],
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """An `AttentionInterface` function: the same output as transformers' sdpa path, cheaper."""
    if softcap is not None:
        raise ValueError("kvnotes_causal does not soft-cap; soft-capping families run eager")
    b, h, q, d = query.shape
    kvh, kv = key.shape[1], key.shape[2]
    g = h // kvh
    p = kv - q
    window = None if sliding_window is None or kv <= sliding_window else int(sliding_window)
    if attention_mask is None and window is None:
        if q == 1:  # one query row per query head, packed per kv group; no mask, no repeat
            out = F.scaled_dot_product_attention(_pack(query, kvh), key, value, scale=scaling)
            return _unpack(out, h, q), None
        if p < q:  # pad p dummy queries in front: top-left causal over a (p + q) square
            qq = query if p == 0 else torch.cat([query.new_zeros(b, h, p, d), query], dim=2)
            out = F.scaled_dot_product_attention(qq, key, value, is_causal=True, scale=scaling,
                                                 enable_gqa=g > 1)[:, :, p:]  # [b, h, q, d]
            return out.transpose(1, 2).contiguous(), None
    if attention_mask is None:
        mask = _memo(kwargs, ("causal", q, kv, window, query.dtype, g),
                     lambda: _additive(causal_allowed(q, kv, window, query.device), query.dtype, g))
    elif attention_mask.ndim == 4 and attention_mask.shape[1] != 1:  # per-head masks: no packing
        raise ValueError("kvnotes_causal takes masks shared by all heads ([b, 1, q, kv])")
    else:
        given = attention_mask
        mask = _memo(kwargs, ("given", id(given), query.dtype, g),
                     lambda: _additive(given, query.dtype, g))
    out = F.scaled_dot_product_attention(_pack(query, kvh), key, value, attn_mask=mask, scale=scaling)
    return _unpack(out, h, q), None


def register() -> str:
    """Register the attention with transformers (idempotent) and return its name.

    No mask function is registered under the name, so transformers builds no mask for it (it
    returns None early) and passes caller-supplied 4D masks through unchanged.
    """
    # deferred: transformers is heavy and only this path needs it
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, causal_attention)
    return NAME
