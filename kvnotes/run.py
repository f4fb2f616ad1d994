"""The one place that runs the model forward against a cache.

A forward pass with a transformers `DynamicCache` extends that cache in place; here every call
builds a fresh `DynamicCache` from an immutable `KVCache`, passes explicit position ids and an
attention mask that covers cached + new tokens, and returns a new `KVCache`. So
prefill(ids[:n]) followed by extend(ids[n:]) is the full forward, and nothing leaks to callers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes import attention
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


@torch.inference_mode()
def read_variants(
    model: LoadedModel,
    base: KVCache,
    src: KVCache,
    positions: Sequence[Sequence[int]],
    ids: Ids,
    layers: Sequence[Sequence[int] | None] | None = None,
    key_mask: Tensor | None = None,
    batch_size: int = 128,
    mask_layers: Tensor | None = None,
    mask_heads: Tensor | None = None,
    capture: list[dict[int, Tensor]] | None = None,
) -> Float[Tensor, "n tail vocab"]:
    """Logits of `ids` after each variant of `base` with K/V at positions[i] (layers[i]) from `src`.

    Equal to `extend(patch(base, src, positions[i], layers[i]), ids)` for every i, without
    building the patched caches (see kvnotes.attention). Knockout: `key_mask[i, p]` hides cached
    key p from the tail at the layers `mask_layers[i]` and query heads `mask_heads[i]` (None: all).
    `capture` (a list) receives one dict per batch of {layer: attention weights of the tail}.
    """
    x = as_ids(model, ids)
    if base.batch != 1 or src.batch != 1 or base.seq_len != src.seq_len:
        raise ValueError("read_variants needs aligned batch-1 caches")
    n, L = len(positions), base.n_layers
    width = max([len(p) for p in positions] + [1])
    pos = torch.full((n, width), -1, dtype=torch.long)
    lay = torch.zeros(n, L, dtype=torch.bool)
    for i, p in enumerate(positions):
        pos[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long)
        chosen = None if layers is None else layers[i]
        lay[i, list(range(L)) if chosen is None else list(chosen)] = True
    if pos.numel() and pos.max() >= base.seq_len:
        raise IndexError(f"positions out of range 0..{base.seq_len - 1}")
    name = attention.register()
    cfg: Any = model.hf.config
    saved = cfg._attn_implementation
    base_d, src_d = base.to(device=model.device), src.to(device=model.device)
    out = []
    try:
        cfg._attn_implementation = name
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
            res = model.hf(
                input_ids=xb,
                position_ids=positions_ids[None].expand(b, -1),
                use_cache=False,
                kvnotes_variants=var,
                logits_to_keep=0,
            )
            out.append(res.logits.float())
            if capture is not None and var.capture is not None:
                capture.append(var.capture)
    finally:
        cfg._attn_implementation = saved
    return torch.cat(out, dim=0)


def _additive_masks(
    model: LoadedModel, q_pos: Tensor, k_pos: Tensor, allowed: Tensor
) -> Tensor | dict[str, Tensor]:
    """4D additive masks [1, 1, q, k] from a boolean `allowed`, one per layer type.

    Sliding-window layers also need |q - k| < window (by position, not cache index); models
    whose layers mix types take a {layer_type: mask} mapping, the others a single mask.
    """
    out: dict[str, Tensor] = {}
    for i, kind in enumerate(model.adapter.layer_types(model.hf)):
        if kind in out:
            continue
        ok = allowed
        window = model.adapter.sliding_window(model.hf, i)
        if window:
            ok = ok & ((q_pos[:, None] - k_pos[None, :]) < window)
        mask = torch.zeros(ok.shape, dtype=model.dtype, device=ok.device)
        out[kind] = mask.masked_fill(~ok, torch.finfo(model.dtype).min)[None, None]
    return next(iter(out.values())) if len(out) == 1 else out


@torch.inference_mode()
def recompute(model: LoadedModel, cache: KVCache, ids: Ids, positions: Sequence[int]) -> KVCache:
    """A copy of `cache` whose K/V at `positions` are recomputed from `ids` against the rest.

    `ids` are the tokens of the whole cached sequence as it should now read (e.g. the new
    prompt); the tokens at `positions` run through the model at their own positions, seeing the
    cached K/V of every other earlier position (stale neighbours) and each other causally:
    selective recompute, what a real system can do without the oracle. All downstream positions
    recomputed equals a re-prefill from the first of them.
    """
    x = as_ids(model, ids)
    n = cache.seq_len
    chosen = sorted(set(int(p) for p in positions))
    if not chosen:
        return cache
    if chosen[0] < 0 or chosen[-1] >= n or x.shape[1] < n:
        raise IndexError(f"positions must be in 0..{n - 1} and ids cover them")
    dev = model.device
    p = torch.tensor(chosen, device=dev)
    j = torch.arange(n, device=dev)
    replaced = torch.zeros(n, dtype=torch.bool, device=dev)
    replaced[p] = True
    see_cache = (j[None, :] < p[:, None]) & ~replaced[None, :]  # [k, n] stale neighbours
    see_new = p[None, :] <= p[:, None]  # [k, k] the recomputed tokens, causally
    allowed = torch.cat([see_cache, see_new], dim=1)  # keys: the n cached, then the k new
    masks = _additive_masks(model, p, torch.cat([j, p]), allowed)
    out = model.hf(
        input_ids=x[:, p],
        past_key_values=cache.to(device=dev).to_dynamic(),
        position_ids=p[None],
        attention_mask=masks,
        use_cache=True,
    )
    fresh = KVCache.from_dynamic(out.past_key_values)

    def put(old: Tensor, new: Tensor) -> Tensor:
        res = old.to(dev).clone()
        res[:, :, p] = new[:, :, n:]
        return res

    return KVCache(
        tuple(put(a, b) for a, b in zip(cache.keys, fresh.keys)),
        tuple(put(a, b) for a, b in zip(cache.values, fresh.values)),
    )


class _Stop(Exception):
    pass


@torch.inference_mode()
def early_keys(model: LoadedModel, ids: Ids, layer: int) -> Float[Tensor, "batch kv_head pos d_head"]:
    """Keys of `layer` for a fresh prefill of `ids`, running only layers 0..layer (CacheBlend's check)."""
    from transformers import DynamicCache

    x = as_ids(model, ids)
    past = DynamicCache()
    target = model.adapter.layers(model.hf)[layer]

    def stop(*_: object) -> None:
        raise _Stop

    handle = target.register_forward_hook(stop)
    try:
        model.hf(input_ids=x, past_key_values=past, use_cache=True,
                 position_ids=torch.arange(x.shape[1], device=model.device)[None])
    except _Stop:
        pass
    finally:
        handle.remove()
    keys: Tensor = getattr(past.layers[layer], "keys")
    return keys
