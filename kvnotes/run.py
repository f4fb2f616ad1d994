"""The one place that runs the model forward against a cache.

A forward pass with a transformers `DynamicCache` extends that cache in place; here every call
builds a fresh `DynamicCache` from an immutable `KVCache`, passes explicit position ids and an
attention mask that covers cached + new tokens, and returns a new `KVCache`. So
prefill(ids[:n]) followed by extend(ids[n:]) is the full forward, and nothing leaks to callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes.cache import KVCache, stack
from kvnotes.models.loading import LoadedModel

Ids = Int[Tensor, "batch pos"] | Sequence[int] | Tensor


@dataclass(frozen=True)
class Step:
    """Logits of the last `logits_to_keep` new positions (fp32) and the extended cache."""

    logits: Float[Tensor, "batch keep vocab"]
    cache: KVCache


def as_ids(model: LoadedModel, ids: Ids) -> Int[Tensor, "batch pos"]:
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.ndim == 1:
        t = t[None]  # [pos] -> [1, pos]
    if t.ndim != 2 or t.shape[1] == 0:
        raise ValueError(f"token ids must be [pos] or [batch, pos] and non-empty, got {tuple(t.shape)}")
    return t.to(model.device)


@torch.inference_mode()
def extend(
    model: LoadedModel, cache: KVCache | None, ids: Ids, logits_to_keep: int = 1
) -> Step:
    """Run `ids` after `cache` (None: from position 0); `logits_to_keep=0` keeps every position."""
    from transformers import DynamicCache

    x = as_ids(model, ids)
    past_len = 0 if cache is None else cache.seq_len
    if cache is not None and cache.batch != x.shape[0]:
        if cache.batch == 1:
            cache = cache.expand(x.shape[0])
        else:
            raise ValueError(f"cache batch {cache.batch} != ids batch {x.shape[0]}")
    past = DynamicCache() if cache is None else cache.to(device=model.device).to_dynamic()
    n = x.shape[1]
    positions = torch.arange(past_len, past_len + n, device=model.device)[None].expand(x.shape[0], -1)
    mask = torch.ones(x.shape[0], past_len + n, dtype=torch.long, device=model.device)
    out = model.hf(
        input_ids=x,
        past_key_values=past,
        position_ids=positions,
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return Step(out.logits.float(), KVCache.from_dynamic(out.past_key_values))


def prefill(model: LoadedModel, ids: Ids, logits_to_keep: int = 1) -> Step:
    """A clean prefill of `ids` from position 0."""
    return extend(model, None, ids, logits_to_keep)


def extend_many(
    model: LoadedModel,
    caches: Sequence[KVCache],
    ids: Ids,
    batch_size: int = 8,
    logits_to_keep: int = 1,
) -> Float[Tensor, "n keep vocab"]:
    """Logits of the same continuation `ids` after each of many equal-length batch-1 caches.

    Patched caches differ only in their K/V, so only the tail has to run: this batches them.
    """
    x = as_ids(model, ids)
    if x.shape[0] != 1:
        raise ValueError("extend_many takes one continuation shared by every cache")
    out = []
    for start in range(0, len(caches), batch_size):
        chunk = stack(caches[start : start + batch_size])
        out.append(extend(model, chunk, x.expand(chunk.batch, -1), logits_to_keep).logits)
    return torch.cat(out, dim=0)


@torch.inference_mode()
def full_logits(model: LoadedModel, ids: Ids) -> Float[Tensor, "batch pos vocab"]:
    """Plain forward without any cache: the reference every cached path must match."""
    x = as_ids(model, ids)
    return model.hf(input_ids=x, use_cache=False).logits.float()
