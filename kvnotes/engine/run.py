"""The one owner of a model's forward: every forward of kvnotes runs in `kvnotes.engine`, and the
attention implementation is switched here only (`attention_impl`).

A forward pass with a transformers `DynamicCache` extends that cache in place; here every call
copies the immutable `KVCache` once into fresh per-layer buffers with room for the new tokens
(a `DynamicCache` of `Slots` layers, whose update writes into that room), passes explicit
position ids, and returns a new `KVCache` over the buffers. So prefill(ids[:n]) followed by
extend(ids[n:]) is the full forward, and nothing leaks to callers. Families that run SDPA
attend through `kvnotes.engine.causal` (no explicit mask where causality suffices); a recompute of
arbitrary positions passes its own mask and writes its K/V in place, into the same buffers.
`extend_into` runs a forward into buffers the caller already holds (no copy): a decode loop, and
the TTFT limit, which must not pay for a copy of the cache that a server keeps in place.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from kvnotes.engine import causal
from kvnotes.engine.cache import (
    KVCache,
    absolute_positions,
    buffers,
    dynamic,
    from_slots,
    slots_class,
    stack,
)
from kvnotes.errors import ConfigError
from kvnotes.models.loading import LoadedModel

Ids = Int[Tensor, "batch pos"] | Sequence[int] | Tensor | str


@dataclass(frozen=True)
class Step:
    """Logits of the new positions (fp32) and the extended cache.

    `logits` is [batch, keep, vocab]: by default keep = 1, the next-token logits of the last
    position (`step.logits[0, -1]`); `all_logits=True` (or `logits_to_keep=0`) keeps every new
    position, as TransformerLens and a plain HF forward return them, and `logits_to_keep=k` the
    last k. `cache` holds every position run so far (docs/conventions.md).
    """

    logits: Float[Tensor, "batch keep vocab"]
    cache: KVCache


def as_ids(model: LoadedModel, ids: Ids, bos: bool = False) -> Int[Tensor, "batch pos"]:
    """[batch, pos] ids on the model's device; a string is tokenized (`bos`: with special tokens)."""
    if isinstance(ids, str):
        if model.tokenizer is None:
            raise ValueError("text needs a tokenizer: wrap_model(hf, tokenizer=...)")
        ids = list(model.tokenizer(ids, add_special_tokens=bos)["input_ids"])
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.ndim == 1:
        t = t[None]  # [pos] -> [1, pos]
    if t.ndim != 2 or t.shape[1] == 0:
        raise ValueError(f"token ids must be [pos] or [batch, pos] and non-empty, got {tuple(t.shape)}")
    return t.to(model.device)


def check_positions(model: LoadedModel, cached: int, new: int) -> None:
    """ConfigError when `cached` + `new` positions pass the model's `max_positions` (its
    max_position_embeddings, set by load_model): RoPE would run on positions it never saw."""
    limit = model.max_positions
    if limit is not None and cached + new > limit:
        what = f"{cached} cached + {new} new = {cached + new}" if cached else str(new)
        raise ConfigError(f"{what} positions exceed model {model.name!r}, which has {limit} "
                          f"(max_position_embeddings); keep prompt and cache within {limit} tokens")


def check_cache(model: LoadedModel, cache: KVCache, what: str = "cache") -> None:
    """ConfigError when `cache` cannot run with `model`: another dtype or another number of layers
    (before the attention kernel's own error). docs/conventions.md, "Dtypes and devices"."""
    if cache.n_layers != model.n_layers:
        raise ConfigError(f"{what} has {cache.n_layers} layers but model {model.name!r} has "
                          f"{model.n_layers}: it was made by another model")
    if cache.dtype != model.dtype:
        have, want = (str(t).removeprefix("torch.") for t in (cache.dtype, model.dtype))
        raise ConfigError(f"{what} is {have} but model {model.name!r} runs in {want}: convert it "
                          f"with cache.to(dtype=torch.{want}) or load the model with dtype={have!r} "
                          f"(docs/conventions.md, dtypes)")


@contextmanager
def attention_impl(model: LoadedModel, name: str) -> Iterator[None]:
    """Run the model with the attention implementation `name` for one call (restored after): the
    one switch of the attention implementation on the model's shared config."""
    cfg: Any = model.hf.config
    saved = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = saved


def _forward(
    model: LoadedModel,
    x: Tensor,
    past: Any,
    positions: Tensor,
    mask: Tensor | dict[str, Tensor] | None = None,
    logits_to_keep: int | None = 1,
) -> Any:
    """One forward of `x` at `positions` into `past`; `logits_to_keep=None` skips the LM head.

    SDPA families attend through kvnotes.engine.causal (no mask built unless `mask` is given); eager
    ones (soft-capping) get transformers' own causal mask from the cache sizes.
    """
    net = model.hf if logits_to_keep is not None else model.adapter.decoder(model.hf)
    kw: dict[str, Any] = dict(input_ids=x, past_key_values=past, position_ids=positions, use_cache=True)
    if logits_to_keep is not None:
        kw["logits_to_keep"] = logits_to_keep
    cfg: Any = model.hf.config
    if cfg._attn_implementation != "sdpa":
        if mask is None:
            mask = torch.ones(x.shape[0], past.get_seq_length() + x.shape[1], dtype=torch.long, device=x.device)
        return net(attention_mask=mask, **kw)
    with attention_impl(model, causal.register()):
        return net(attention_mask=mask, **{causal.MEMO: {}}, **kw)


@torch.inference_mode()
def extend(
    model: LoadedModel, cache: KVCache | None, ids: Ids, logits_to_keep: int = 1,
    all_logits: bool = False,
) -> Step:
    """Run `ids` (or text, tokenized without special tokens) after `cache` (None: from position 0).

    Logits of the last new position, or of every new one with `all_logits=True` (same as
    `logits_to_keep=0`). The cache is copied once into buffers with room for `ids`
    (`extend_into` runs the forward into them), so `cache` itself is never changed.
    """
    logits_to_keep = _keep(logits_to_keep, all_logits)
    x = as_ids(model, ids)
    b, n = x.shape
    if cache is not None and cache.batch not in (1, b):
        raise ValueError(f"cache batch {cache.batch} != ids batch {b}")
    if cache is not None:
        check_cache(model, cache)
    if cache is None:  # buffers shaped by the first layer's states, inside the forward
        return _run_slots(model, x, [slots_class()(None, None, 0, n) for _ in range(model.n_layers)], 0,
                          logits_to_keep)
    keys, values = buffers(cache, n, b, model.device)
    return extend_into(model, keys, values, cache.seq_len, x, logits_to_keep)


@torch.inference_mode()
def extend_into(
    model: LoadedModel,
    keys: Sequence[Tensor],
    values: Sequence[Tensor],
    filled: int,
    ids: Ids,
    logits_to_keep: int = 1,
) -> Step:
    """`ids` after a cache held in buffers, its K/V written into the buffers' next slots: no copy.

    `keys[i]`/`values[i]` are [batch, kv_head, >= filled + len(ids), d_head] buffers whose first
    `filled` slots hold the cache; slots from `filled` on are scratch, overwritten. The returned
    cache is a view of the first filled + len(ids) slots: a decode loop over one set of buffers
    (`compose.greedy`) copies nothing, and the TTFT limit (the question over a cache already in
    place) is timed through it. `extend` is one copy into fresh buffers, then this.
    """
    x = as_ids(model, ids)
    b, n = x.shape
    if len(keys) != model.n_layers or len(values) != model.n_layers:
        raise ValueError(f"{model.n_layers} layers of buffers needed, got {len(keys)} and {len(values)}")
    room = min(int(k.shape[2]) for k in (*keys, *values))
    if filled < 0 or filled + n > room:
        raise ValueError(f"buffers hold {room} positions; {filled} filled + {n} new do not fit")
    if any(int(t.shape[0]) != b for t in (*keys, *values)):
        raise ValueError(f"buffers' batch differs from the ids' batch {b}")
    check_cache(model, KVCache(tuple(keys), tuple(values)), "the buffers' cache")
    return _run_slots(model, x, [slots_class()(k, v, filled, n) for k, v in zip(keys, values)], filled,
                      logits_to_keep)


def _run_slots(model: LoadedModel, x: Tensor, layers: list[Any], start: int, logits_to_keep: int) -> Step:
    """`x` forwarded at positions start.. into `Slots` layers; the cache is a view of their buffers."""
    check_positions(model, start, x.shape[1])
    past = dynamic(layers)
    positions = torch.arange(start, start + x.shape[1], device=model.device)[None].expand(x.shape[0], -1)
    out = _forward(model, x, past, positions, logits_to_keep=logits_to_keep)
    return Step(out.logits.float(), from_slots(past))


def _keep(logits_to_keep: int, all_logits: bool) -> int:
    """The LM head's `logits_to_keep` (0: every position) from the public arguments."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ConfigError(f"logits_to_keep={logits_to_keep!r}: the last k >= 1, or 0 (all_logits=True)")
    return 0 if all_logits else logits_to_keep


def prefill(model: LoadedModel, ids: Ids, logits_to_keep: int = 1, all_logits: bool = False) -> Step:
    """A clean prefill of `ids` from position 0; text is tokenized as the tokenizer does (BOS too).

    `step.logits` is [batch, 1, vocab] (the next token), or [batch, pos, vocab] with
    `all_logits=True`; `step.cache` holds all pos tokens (docs/conventions.md).
    """
    return extend(model, None, as_ids(model, ids, bos=True), logits_to_keep, all_logits)


def extend_many(
    model: LoadedModel,
    caches: Sequence[KVCache],
    ids: Ids,
    batch_size: int = 8,
    logits_to_keep: int = 1,
    all_logits: bool = False,
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
        out.append(extend(model, chunk, x.expand(chunk.batch, -1), logits_to_keep, all_logits).logits)
    return torch.cat(out, dim=0)


@torch.inference_mode()
def full_logits(model: LoadedModel, ids: Ids) -> Float[Tensor, "batch pos vocab"]:
    """Plain forward without any cache (text: special tokens added, as `prefill`): the reference."""
    x = as_ids(model, ids, bos=True)
    return model.hf(input_ids=x, use_cache=False).logits.float()


def additive_masks(
    model: LoadedModel, q_pos: Tensor, k_pos: Tensor, allowed: Tensor
) -> Tensor | dict[str, Tensor]:
    """4D additive masks [batch, 1, q, k] from a boolean `allowed` ([q, k] gives batch 1, or
    [batch, q, k]), one per layer type.

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
        mask = mask.masked_fill(~ok, torch.finfo(model.dtype).min)
        out[kind] = mask.reshape(-1, 1, *ok.shape[-2:])  # [batch or 1, 1, q, k]
    return next(iter(out.values())) if len(out) == 1 else out


@torch.inference_mode()
def forward_at(
    model: LoadedModel,
    keys: Sequence[Tensor],
    values: Sequence[Tensor],
    n: int,
    ids: Ids,
    positions: Sequence[int] | Tensor,
    logits_to_keep: int | None = None,
) -> Tensor | None:
    """One forward of tokens at arbitrary positions into a cache held in buffers, in place.

    `keys[i]`/`values[i]` are [1, kv_head, >= n + k, d_head] buffers whose first n slots hold
    the cache (finite everywhere) and whose next k = len(positions) slots are scratch. `ids` are
    the k tokens; `positions` are sorted and distinct: those below n are recomputed (their K/V
    replace the cached ones), those from n on must be n, n + 1, ... and are appended (the cache
    grows by their number). Token s reads every cached position before s that is not replaced,
    and the forwarded tokens at positions <= s: selective recompute and an extension, fused.
    Returns the logits of the last `logits_to_keep` tokens (fp32), or None (no LM head).
    """
    x = as_ids(model, ids)
    dev = model.device
    p = torch.as_tensor(positions, dtype=torch.long, device=dev)
    k = int(p.numel())
    if x.shape != (1, k):
        raise ValueError(f"{k} positions need ids of shape [1, {k}], got {tuple(x.shape)}")
    if k == 0:
        raise ValueError("nothing to forward")
    if int(p.min()) < 0 or (k > 1 and not bool((p[1:] > p[:-1]).all())):
        raise IndexError("positions must be sorted, distinct and >= 0")
    grown = p[p >= n]
    if grown.numel() and not torch.equal(grown, torch.arange(n, n + grown.numel(), device=dev)):
        raise IndexError(f"positions from {n} on must be {n}, {n + 1}, ... (appended)")
    check_positions(model, n, int(grown.numel()))
    j = torch.arange(n, device=dev)
    replaced = torch.zeros(n, dtype=torch.bool, device=dev)
    replaced[p[p < n]] = True
    see_cache = (j[None, :] < p[:, None]) & ~replaced[None, :]  # [k, n] the other, earlier positions
    see_new = p[None, :] <= p[:, None]  # [k, k] the forwarded tokens, causally
    allowed = torch.cat([see_cache, see_new], dim=1)  # keys: the n cached, then the k new
    masks = additive_masks(model, p, torch.cat([j, p]), allowed)
    past = dynamic([slots_class()(kb, vb, n, k) for kb, vb in zip(keys, values)])
    out = _forward(model, x, past, p[None], mask=masks, logits_to_keep=logits_to_keep)
    for buf in (*keys, *values):
        buf[:, :, p] = buf[:, :, n : n + k].clone()  # [1, kv_head, k, d_head] into their slots
    return None if logits_to_keep is None else out.logits.float()


@torch.inference_mode()
def recompute(model: LoadedModel, cache: KVCache, ids: Ids, positions: Sequence[int]) -> KVCache:
    """A copy of `cache` whose K/V at `positions` (negative: from the end) are recomputed from
    `ids` against the rest.

    `ids` are the tokens of the whole cached sequence as it should now read (e.g. the new
    prompt); the tokens at `positions` run through the model at their own positions, seeing the
    cached K/V of every other earlier position (stale neighbours) and each other causally:
    selective recompute, what a real system can do without the oracle. All downstream positions
    recomputed equals a re-prefill from the first of them. One copy of the cache, one forward of
    the chosen tokens (no LM head).
    """
    x = as_ids(model, ids)
    check_cache(model, cache)
    n = cache.seq_len
    chosen = sorted(set(absolute_positions(list(positions), n).tolist()))  # negative: from the end
    if not chosen:
        return cache
    if x.shape[1] < n:
        raise IndexError(f"ids ({x.shape[1]} tokens) must cover the {n} cached positions")
    if cache.batch != 1:
        raise ValueError(f"recompute takes a batch-1 cache, got batch {cache.batch}")
    keys, values = buffers(cache, len(chosen), 1, model.device)
    forward_at(model, keys, values, n, x[:, chosen], chosen)
    return KVCache(tuple(kb[:, :, :n] for kb in keys), tuple(vb[:, :, :n] for vb in values))


@torch.inference_mode()
def recompute_extend(
    model: LoadedModel,
    cache: KVCache,
    ids: Ids,
    positions: Sequence[int],
    tail: Ids,
    logits_to_keep: int = 1,
    all_logits: bool = False,
) -> Step:
    """`extend(recompute(cache, ids, positions), tail)` in one forward and one copy of the cache
    (logits of the tail's last token, or of every tail token with `all_logits=True`)."""
    logits_to_keep = _keep(logits_to_keep, all_logits)
    x, t = as_ids(model, ids), as_ids(model, tail)
    check_cache(model, cache)
    n = cache.seq_len
    chosen = sorted(set(absolute_positions(list(positions), n).tolist()))  # negative: from the end
    if not chosen:
        return extend(model, cache, t, logits_to_keep)
    if x.shape[1] < n:
        raise IndexError(f"ids ({x.shape[1]} tokens) must cover the {n} cached positions")
    if cache.batch != 1 or t.shape[0] != 1:
        raise ValueError("recompute_extend takes a batch-1 cache and one tail")
    m = t.shape[1]
    keys, values = buffers(cache, len(chosen) + m, 1, model.device)
    toks = torch.cat([x[:, chosen], t], dim=1)
    keep = m if logits_to_keep == 0 else min(logits_to_keep, m)
    logits = forward_at(model, keys, values, n, toks, [*chosen, *range(n, n + m)], logits_to_keep=keep)
    assert logits is not None
    return Step(logits, KVCache(tuple(k[:, :, : n + m] for k in keys), tuple(v[:, :, : n + m] for v in values)))


@torch.inference_mode()
def prefill_at(model: LoadedModel, ids: Ids, start: int) -> KVCache:
    """K/V of `ids` prefilled alone at positions start.. (the reference a rotation by `start` of
    the block prefilled at 0 must match); `prefill` starts at position 0."""
    # deferred: transformers is heavy and only this path needs it
    from transformers import DynamicCache

    x = as_ids(model, ids)
    pos = torch.arange(start, start + x.shape[1], device=model.device)[None]  # [1, pos]
    out = model.hf(input_ids=x, position_ids=pos, past_key_values=DynamicCache(), use_cache=True)
    return KVCache.from_dynamic(out.past_key_values)
