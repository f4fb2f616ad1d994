"""The time-to-first-token limit: the question forwarded against an already cached context.

Timed only through `kvnotes.engine.run.extend`, the limit would carry our own per-call costs (buffers,
masks) and flatter whatever is compared with it. Timed only through transformers it carries
transformers' costs instead: with a mask and more than one query token, its SDPA path expands
grouped keys and values to every query head (`repeat_kv`), a copy of the whole cache times the
group size (7x on Qwen2.5-0.5B, 3x on SmolLM2), so at long contexts it runs slower than our
engine's forward of the seam *and* the question. Both of those also copy the whole cache once
(`DynamicCache.update` concatenates; `run.extend` copies into buffers with room), which a server
holding the context in place does not do. So three paths are timed side by side:
`bare_forward` here (a transformers forward over a `DynamicCache` filled by its own `update`;
nothing of kvnotes on the path), `kvnotes.engine.run.extend`, and `kvnotes.engine.run.extend_into` over
buffers that already hold the context with room for the question (`inplace`: no copy). The limit
is the fastest of them (`fastest`), with the path named. A forward extends a DynamicCache in
place, so build a fresh one (untimed) before every timed call; `extend_into` overwrites the same
scratch slots on every call, so its buffers are built once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvnotes.engine.cache import KVCache
from kvnotes.models.loading import LoadedModel


def bare_cache(context: KVCache) -> Any:
    """A transformers DynamicCache holding `context`, filled by its own update."""
    # deferred: transformers is heavy and only this path needs it
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


def fastest(**speedups: float | None) -> tuple[float | None, str | None]:
    """The limit's speedup and its path: the largest of the named speedups (the fastest forward),
    e.g. `fastest(bare=..., engine=..., inplace=...)`; paths not timed are None."""
    timed = [(v, name) for name, v in speedups.items() if v is not None]
    return max(timed) if timed else (None, None)
