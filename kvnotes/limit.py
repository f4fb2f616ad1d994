"""The time-to-first-token limit, defined outside kvnotes' own call path.

The limit of any cache reuse is the question forwarded against an already cached context. Timed
through `kvnotes.run.extend` it would carry our own per-call costs (buffers, masks) and flatter
whatever it is compared with, so here it is a bare transformers forward over a `DynamicCache`
filled by its own `update`, with the model's own attention: nothing of kvnotes is on the path.
A forward extends a DynamicCache in place, so build a fresh one (untimed) before every timed call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvnotes.cache import KVCache
from kvnotes.models.loading import LoadedModel


def bare_cache(context: KVCache) -> Any:
    """A transformers DynamicCache holding `context`, filled by its own update."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(context.keys, context.values)):
        cache.update(k.contiguous(), v.contiguous(), i)
    return cache


@torch.inference_mode()
def bare_forward(model: LoadedModel, cache: Any, ids: Tensor) -> Tensor:
    """`ids` ([1, n]) against `cache` with transformers alone; the last position's logits (fp32)."""
    past = cache.get_seq_length()
    pos = torch.arange(past, past + ids.shape[1], device=model.device)[None]
    out = model.hf(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float()
