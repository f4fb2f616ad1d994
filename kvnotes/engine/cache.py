"""The KV cache as an immutable value: per-layer keys and values, indexed by absolute position.

`KVCache` holds, for every layer, keys and values of shape [batch, kv_head, pos, d_head] with
keys already rotated (post-RoPE), exactly what attention reads. Every operation returns a new
cache; conversion to a transformers `DynamicCache` builds full (non-sliding) layers, so the cache
index of a token is always its absolute position, on sliding-window layers too (the sliding
mask is applied from positions, not by dropping entries). A forward writes into `Slots` layers:
per-layer buffers with room for its new tokens, so the old cache is copied once, up front, and
a recompute writes its K/V into place without a second copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

KV = Float[Tensor, "batch kv_head pos d_head"]


def absolute_positions(positions: Sequence[int] | Tensor, n: int) -> Tensor:
    """Positions of a cache of `n` as a long tensor in 0..n-1; negative ones count from the end
    (-1 is the last cached token), as Python and TransformerLens do. IndexError past either end."""
    idx = torch.as_tensor(positions, dtype=torch.long)
    bad = idx[(idx < -n) | (idx >= n)]
    if bad.numel():
        raise IndexError(f"position {int(bad[0])} out of range for a cache of {n} positions (valid: "
                         f"0..{n - 1}, or -{n}..-1 from the end; docs/conventions.md, positions)")
    return torch.where(idx < 0, idx + n, idx)


@dataclass(frozen=True)
class KVCache:
    keys: tuple[KV, ...]
    values: tuple[KV, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("a KVCache needs the same, non-zero number of key and value layers")
        shape = self.keys[0].shape
        for k, v in zip(self.keys, self.values, strict=True):
            if k.shape[:3] != shape[:3] or v.shape[:3] != shape[:3]:
                raise ValueError(f"inconsistent layer shapes: {tuple(k.shape)} / {tuple(v.shape)}")

    # --- shape facts -----------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.keys[0].shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def __len__(self) -> int:
        return self.seq_len

    # --- transformers interop ---------------------------------------------------------------
    def to_dynamic(self) -> Any:  # transformers.DynamicCache
        """A fresh `DynamicCache` of full layers over these tensors, without copying them.

        A forward pass *rebinds* each layer's keys to `torch.cat([old, new])`, a new tensor, so
        our tensors are never written to; only in-place writes into the layers' tensors (which
        nothing in transformers' DynamicLayer does) could reach them.
        """
        # deferred: transformers is heavy and only this path needs it
        from transformers import DynamicCache

        # deferred: transformers is heavy and only this path needs it
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache()
        layers: list[Any] = []
        for k, v in zip(self.keys, self.values, strict=True):
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            layers.append(layer)
        cache.layers = layers
        return cache

    @classmethod
    def from_dynamic(cls, cache: Any) -> KVCache:  # cache: transformers.Cache
        layers = cache.layers
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError(
                "this DynamicCache has sliding-window layers, which keep only the last window "
                "(cache index != position); build caches with kvnotes.engine.run.prefill instead"
            )
        return cls(tuple(layer.keys for layer in layers), tuple(layer.values for layer in layers))

    # --- value operations -------------------------------------------------------------------
    def map(self, fn: Callable[[Tensor], Tensor]) -> KVCache:  # applied to every K and V
        return KVCache(tuple(fn(k) for k in self.keys), tuple(fn(v) for v in self.values))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVCache:
        return self.map(lambda t: t.to(device=device, dtype=dtype))

    def clone(self) -> KVCache:
        return self.map(lambda t: t.clone())

    def slice(self, start: int, stop: int | None = None) -> KVCache:
        """Positions [start, stop) of every layer."""
        return self.map(lambda t: t[:, :, start:stop])

    def select(self, positions: Sequence[int] | Tensor) -> KVCache:
        """Positions `positions` of every layer, in that order (negative: from the end)."""
        idx = absolute_positions(positions, self.seq_len).to(self.device)
        return self.map(lambda t: t.index_select(2, idx))

    def batch_item(self, i: int) -> KVCache:
        return self.map(lambda t: t[i : i + 1])

    def expand(self, batch: int) -> KVCache:
        """Repeat a batch-1 cache `batch` times (a view: copy before writing into it)."""
        if self.batch != 1:
            raise ValueError(f"expand needs a batch-1 cache, got batch {self.batch}")
        return self.map(lambda t: t.expand(batch, -1, -1, -1))

    def allclose(self, other: KVCache, atol: float = 0.0) -> bool:
        return self.max_abs_diff(other) <= atol

    def max_abs_diff(self, other: KVCache) -> float:
        if self.n_layers != other.n_layers or self.seq_len != other.seq_len:
            raise ValueError("caches differ in layers or length")
        diffs = [
            (a.float() - b.float()).abs().max().item()
            for a, b in zip(self.keys + self.values, other.keys + other.values)
        ]
        return float(max(diffs))


def cat(caches: Sequence[KVCache]) -> KVCache:
    """Concatenate caches along positions (keys must already sit at their final positions)."""
    n = {c.n_layers for c in caches}
    if len(n) != 1:
        raise ValueError(f"cannot concatenate caches with different layer counts {sorted(n)}")
    layers = range(caches[0].n_layers)
    return KVCache(
        tuple(torch.cat([c.keys[i] for c in caches], dim=2) for i in layers),
        tuple(torch.cat([c.values[i] for c in caches], dim=2) for i in layers),
    )


def stack(caches: Sequence[KVCache]) -> KVCache:
    """Stack batch-1 caches of equal length into one batch (for batched decision reads)."""
    lengths = {c.seq_len for c in caches}
    if len(lengths) != 1:
        raise ValueError(f"cannot stack caches of different lengths {sorted(lengths)}")
    layers = range(caches[0].n_layers)
    return KVCache(
        tuple(torch.cat([c.keys[i] for c in caches], dim=0) for i in layers),
        tuple(torch.cat([c.values[i] for c in caches], dim=0) for i in layers),
    )


def patch(
    dst: KVCache,
    src: KVCache,
    positions: Sequence[int] | Tensor | None = None,
    layers: Sequence[int] | None = None,
) -> KVCache:
    """A copy of `dst` whose K and V at `positions` (all if None; negative ones count from the
    end) and `layers` (all) come from `src`.

    Both caches must be aligned (same positions mean the same token slots), as old and new
    prompts of a task item are by construction.
    """
    if dst.n_layers != src.n_layers or dst.seq_len != src.seq_len or dst.batch != src.batch:
        raise ValueError(
            f"patch needs aligned caches: dst {dst.n_layers}x{dst.seq_len}, src {src.n_layers}x{src.seq_len}"
        )
    chosen = set(range(dst.n_layers)) if layers is None else set(layers)
    bad = [layer for layer in chosen if not 0 <= layer < dst.n_layers]
    if bad:
        raise IndexError(f"layers {bad} out of range 0..{dst.n_layers - 1}")
    idx = None if positions is None else absolute_positions(positions, dst.seq_len).to(dst.device)

    def one(a: Tensor, b: Tensor, i: int) -> Tensor:
        if i not in chosen:
            return a
        if idx is None:
            return b.clone()
        out = a.clone()
        out[:, :, idx] = b[:, :, idx].to(a.dtype)
        return out

    return KVCache(
        tuple(one(a, b, i) for i, (a, b) in enumerate(zip(dst.keys, src.keys))),
        tuple(one(a, b, i) for i, (a, b) in enumerate(zip(dst.values, src.values))),
    )


# --- buffers a forward writes into (kvnotes.engine.run) -------------------------------------------


@functools.cache
def slots_class() -> Any:
    """`Slots`, a transformers DynamicLayer subclass (built on first use: no import at load)."""
    # deferred: transformers is heavy and only this path needs it
    from transformers.cache_utils import DynamicLayer

    class Slots(DynamicLayer):
        """A full-attention layer over [batch, kv_head, capacity, d_head] buffers.

        `update` writes the new K/V into the slots after the `filled` ones and returns the filled
        prefix (the whole buffer when it is exactly full, as after every `extend`): the old cache
        is copied once, when the buffers are built, and the forward itself copies nothing.
        """

        def __init__(self, keys: Tensor | None, values: Tensor | None, filled: int, room: int) -> None:
            super().__init__()
            self.keys, self.values, self.filled, self.room = keys, values, filled, room
            if keys is not None:
                self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

        def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
            n = key_states.shape[-2]
            if self.keys is None:  # empty cache: buffers shaped like the first states
                b, h, _, d = key_states.shape
                size = max(self.room, n)
                dt, dev = key_states.dtype, key_states.device
                self.keys = torch.empty(b, h, size, d, dtype=dt, device=dev)
                self.values = torch.empty(b, h, size, value_states.shape[-1], dtype=dt, device=dev)
                self.dtype, self.device, self.is_initialized = dt, dev, True
            keys, values = self.keys, self.values
            assert keys is not None and values is not None
            end = self.filled + n
            if end > keys.shape[2]:
                raise RuntimeError(f"cache buffer holds {keys.shape[2]} positions, {end} needed")
            keys[:, :, self.filled : end].copy_(key_states)
            values[:, :, self.filled : end].copy_(value_states)
            self.filled = end
            return keys[:, :, :end], values[:, :, :end]

        def get_seq_length(self) -> int:
            return int(self.filled)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.filled + query_length, 0

    return Slots


def buffers(cache: KVCache, room: int, batch: int, device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer [batch, kv_head, n + room, d_head] buffers holding `cache` in [:n] (one copy)."""
    n = cache.seq_len
    keys, values = [], []
    for k, v in zip(cache.keys, cache.values):
        kb = torch.empty(batch, k.shape[1], n + room, k.shape[3], dtype=k.dtype, device=device)
        vb = torch.empty(batch, v.shape[1], n + room, v.shape[3], dtype=v.dtype, device=device)
        kb[:, :, :n].copy_(k)  # broadcasts a batch-1 cache over the batch
        vb[:, :, :n].copy_(v)
        keys.append(kb)
        values.append(vb)
    return keys, values


def dynamic(layers: list[Any]) -> Any:
    # deferred: transformers is heavy and only this path needs it
    from transformers import DynamicCache

    past = DynamicCache()
    past.layers = layers
    return past


def from_slots(past: Any) -> KVCache:
    return KVCache(tuple(layer.keys[:, :, : layer.filled] for layer in past.layers),
                   tuple(layer.values[:, :, : layer.filled] for layer in past.layers))
