"""References computed with the plain transformers model only (no kvnotes.engine.run, no kvnotes.engine.cache):
the K/V of a prefill and a forward of tokens after hand-built per-layer K/V."""

from __future__ import annotations

import torch
from torch import Tensor

from kvnotes.models.loading import LoadedModel

KV = list[tuple[Tensor, Tensor]]  # per layer: keys, values [1, kv_head, pos, d_head]


def _cache(kv: KV):
    """A DynamicCache of full layers (no config: sliding layers keep every position)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), layer)
    return cache


@torch.inference_mode()
def forward(model: LoadedModel, kv: KV | None, ids: list[int], start: int) -> tuple[Tensor, KV]:
    """Logits [pos, vocab] (fp32) of `ids` at positions start.. after `kv` (None: empty), and the
    K/V of everything after the forward (`kv` then the new tokens)."""
    from transformers import DynamicCache

    cache = DynamicCache() if kv is None else _cache(kv)
    assert cache.get_seq_length() == start
    x = torch.tensor([ids])
    pos = torch.arange(start, start + len(ids))[None]
    out = model.hf(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=True)
    kv_out = [(lay.keys, lay.values) for lay in out.past_key_values.layers]
    return out.logits[0].float(), kv_out


def prefill_kv(model: LoadedModel, ids: list[int]) -> KV:
    return forward(model, None, ids, 0)[1]
