"""The KV cache as an immutable value: per-layer keys and values, indexed by absolute position.

`KVCache` holds, for every layer, keys and values of shape [batch, kv_head, pos, d_head] with
keys already rotated (post-RoPE), exactly what attention reads. Every operation returns a new
cache; conversion to a transformers `DynamicCache` builds full (non-sliding) layers, so the cache
index of a token is always its absolute position, on sliding-window layers too (the sliding
mask is applied from positions, not by dropping entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor

KV = Float[Tensor, "batch kv_head pos d_head"]


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
    def to_dynamic(self):  # -> transformers.DynamicCache
        """A fresh `DynamicCache` of full layers over these tensors, without copying them.

        A forward pass *rebinds* each layer's keys to `torch.cat([old, new])`, a new tensor, so
        our tensors are never written to; only in-place writes into the layers' tensors (which
        nothing in transformers' DynamicLayer does) could reach them.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache()
        layers = []
        for k, v in zip(self.keys, self.values, strict=True):
            layer = DynamicLayer()
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
            layers.append(layer)
        cache.layers = layers
        return cache

    @classmethod
    def from_dynamic(cls, cache) -> KVCache:  # cache: transformers.Cache
        layers = cache.layers
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError(
                "this DynamicCache has sliding-window layers, which keep only the last window "
                "(cache index != position); build caches with kvnotes.run.prefill instead"
            )
        return cls(tuple(layer.keys for layer in layers), tuple(layer.values for layer in layers))

    # --- value operations -------------------------------------------------------------------
    def map(self, fn) -> KVCache:  # fn: Tensor -> Tensor applied to every K and V
        return KVCache(tuple(fn(k) for k in self.keys), tuple(fn(v) for v in self.values))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> KVCache:
        return self.map(lambda t: t.to(device=device, dtype=dtype))

    def clone(self) -> KVCache:
        return self.map(lambda t: t.clone())

    def slice(self, start: int, stop: int | None = None) -> KVCache:
        """Positions [start, stop) of every layer."""
        return self.map(lambda t: t[:, :, start:stop])

    def select(self, positions: Sequence[int] | Tensor) -> KVCache:
        idx = torch.as_tensor(positions, dtype=torch.long, device=self.device)
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
    """A copy of `dst` whose K and V at `positions` (all if None) and `layers` (all) come from `src`.

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
    if positions is None:
        idx = None
    else:
        idx = torch.as_tensor(positions, dtype=torch.long, device=dst.device)
        if idx.numel() and (idx.min() < 0 or idx.max() >= dst.seq_len):
            raise IndexError(f"positions out of range 0..{dst.seq_len - 1}")

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
