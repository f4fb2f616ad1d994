"""Reads of many variants of one cache without building them: the patching map's engine.

`read_variants` runs one continuation after each of many variants of a base cache (K/V at some
positions taken from a source cache; optionally keys hidden from the tail), in batches, through
the `kvnotes.engine.attention` implementation: equal to extending each materialised patched cache, at a
fraction of the memory and time. One room of the engine beside `run`, which holds the forwards
over one cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.engine import attention
from kvnotes.engine.cache import KVCache, absolute_positions
from kvnotes.engine.run import Ids, as_ids, attention_impl, check_cache
from kvnotes.measure import timing
from kvnotes.models.loading import LoadedModel


def variant_batch_size(model: LoadedModel, n_cached: int, tail: int, width: int,
                       fraction: float = 0.5, cap: int = 1024) -> int:
    """How many variants `read_variants` runs at once: `fraction` of the free memory over an
    estimate of one variant's working set (fp32 scores and weights of the tail over the cache in
    one layer, about 8 copies; the patched K/V gathered; the tail's hidden states and logits)."""

    cfg = model.config
    heads, d = model.adapter.n_heads(model.hf), model.adapter.head_dim(model.hf)
    per = 4 * (8 * heads * tail * (n_cached + tail + width)  # scores, softmax, scatter copies
               + 4 * model.adapter.n_kv_heads(model.hf) * width * d  # gathered K/V and their change
               + 24 * tail * int(cfg.hidden_size)  # hidden states, MLP activations
               + 2 * tail * int(cfg.vocab_size))  # logits (fp32 and the model's dtype)
    return max(1, min(cap, int(fraction * timing.available_bytes(model.device)) // per))


@torch.inference_mode()
def read_variants(
    model: LoadedModel,
    base: KVCache,
    src: KVCache,
    positions: Sequence[Sequence[int]],
    ids: Ids,
    layers: Sequence[Sequence[int] | None] | None = None,
    key_mask: Tensor | None = None,
    batch_size: int | None = None,
    mask_layers: Tensor | None = None,
    mask_heads: Tensor | None = None,
    capture: list[dict[int, Tensor]] | None = None,
    vocab: Sequence[int] | None = None,
) -> Float[Tensor, "n tail vocab"]:
    """Logits of `ids` after each variant of `base` with K/V at positions[i] (layers[i]) from `src`.

    Equal to `extend(patch(base, src, positions[i], layers[i]), ids)` for every i (negative
    positions count from the end of the cache, as in `patch`), without
    building the patched caches (see kvnotes.engine.attention). Knockout: `key_mask[i, p]` hides cached
    key p from the tail at the layers `mask_layers[i]` and query heads `mask_heads[i]` (None: all).
    `capture` (a list) receives one dict per batch of {layer: attention weights of the tail}.
    `batch_size` variants run at once (None: as many as half the free memory holds). `vocab`:
    only the logits of these token ids ([n, tail, len(vocab)]), the LM head's other rows skipped.
    """
    x = as_ids(model, ids)
    if base.batch != 1 or src.batch != 1 or base.seq_len != src.seq_len:
        raise ValueError("read_variants needs aligned batch-1 caches")
    check_cache(model, base)
    check_cache(model, src, "the source cache")
    positions = [absolute_positions(list(p), base.seq_len).tolist() for p in positions]  # -1: last
    n, L = len(positions), base.n_layers
    width = max([len(p) for p in positions] + [1])
    if batch_size is None:
        batch_size = variant_batch_size(model, base.seq_len, x.shape[1], width)
    pos = torch.full((n, width), -1, dtype=torch.long)
    lay = torch.zeros(n, L, dtype=torch.bool)
    for i, p in enumerate(positions):
        pos[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        chosen = None if layers is None else layers[i]
        lay[i, list(range(L)) if chosen is None else list(chosen)] = True
    name = attention.register()
    base_d, src_d = base.to(device=model.device), src.to(device=model.device)
    out = []
    with attention_impl(model, name):
        for s in range(0, n, batch_size):
            b = min(batch_size, n - s)
            sl = slice(s, s + b)
            var = attention.Variants(
                base_d, src_d, pos[sl], lay[sl],
                None if key_mask is None else key_mask[sl],
                None if mask_layers is None else mask_layers[sl],
                None if mask_heads is None else mask_heads[sl],
                None if capture is None else {},
            )
            xb = x.expand(b, -1)
            positions_ids = torch.arange(base.seq_len, base.seq_len + x.shape[1], device=model.device)
            kw = dict(input_ids=xb, position_ids=positions_ids[None].expand(b, -1), use_cache=False,
                      kvnotes_variants=var)
            if vocab is None:
                out.append(model.hf(**kw, logits_to_keep=0).logits.float())
            else:
                hidden = model.adapter.decoder(model.hf)(**kw).last_hidden_state  # [b, tail, d]
                out.append(logits_of(model, hidden, vocab))
            if capture is not None and var.capture is not None:
                capture.append(var.capture)
    return torch.cat(out, dim=0)


def logits_of(model: LoadedModel, hidden: Tensor, vocab: Sequence[int]) -> Float[Tensor, "b t k"]:
    """The LM head's logits of the token ids `vocab` only (fp32), final soft-capping included."""
    head: Any = model.adapter.unembed(model.hf)
    idx = torch.as_tensor(list(vocab), dtype=torch.long, device=hidden.device)
    bias = None if getattr(head, "bias", None) is None else head.bias[idx]
    logits = torch.nn.functional.linear(hidden, head.weight[idx], bias)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()
