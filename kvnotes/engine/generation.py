"""Generation from a kvnotes cache: transformers' `generate` continuing after a `KVCache`.

The cache is handed to `generate` as a `DynamicCache` over its tensors (a forward rebinds each
layer, never writes into ours), so the caller's cache is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from kvnotes.engine.cache import KVCache
from kvnotes.engine.run import Ids, as_ids, check_cache
from kvnotes.models.loading import LoadedModel


@torch.inference_mode()
def generate(model: LoadedModel, cache: KVCache, ids: Ids, max_new_tokens: int, **kwargs: Any) -> Any:
    """transformers' `generate` continuing `ids` after `cache` (a `DynamicCache` copy of it, so
    `cache` is unchanged); `kwargs` pass through (sampling, `num_return_sequences`, ...)."""
    x = as_ids(model, ids)
    check_cache(model, cache)
    return model.hf.generate(  # type: ignore[operator]
        input_ids=x, attention_mask=torch.ones_like(x),
        past_key_values=cache.to(device=model.device).to_dynamic(),
        max_new_tokens=max_new_tokens, **kwargs,
    )
