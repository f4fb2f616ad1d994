"""Partial forwards: a fresh prefill that stops after one layer, for the keys and values of that
layer alone (CacheBlend's deviation check reads them without paying for the full prefill)."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

from kvnotes.engine.run import Ids, as_ids
from kvnotes.models.loading import LoadedModel


class _Stop(Exception):
    pass


@torch.inference_mode()
def early_keys(model: LoadedModel, ids: Ids, layer: int) -> Float[Tensor, "batch kv_head pos d_head"]:
    """Keys of `layer` for a fresh prefill of `ids`, running only layers 0..layer (CacheBlend's check)."""
    return early_kv(model, ids, layer)[0]


@torch.inference_mode()
def early_kv(model: LoadedModel, ids: Ids, layer: int) -> tuple[Tensor, Tensor]:
    """Keys and values [batch, kv_head, pos, d_head] of `layer` for a fresh prefill of `ids`,
    running only layers 0..layer (the forward stops after that layer)."""
    # deferred: transformers is heavy and only this path needs it
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
    values: Tensor = getattr(past.layers[layer], "values")
    return keys, values
